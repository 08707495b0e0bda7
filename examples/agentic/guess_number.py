"""The multi-turn environment of examples/agentic_game_smollm2.yaml: guess a number, told "Higher." or "Lower.".

Why this game: every reply of the environment is a user turn that the model has to read (the hint), the episode
ends when the environment says so (a right guess) or at the recipe's ``max_turns``, and the reward is the
environment's own (``get_reward``), so it exercises the whole multi-turn loop (``reset`` / ``step``,
rl/env_steps.py). Why this reward: a 135M-parameter model learns within ~30 CPU steps only if the reward has a
gradient, so half of it is partial credit for how far the hints narrowed the range (a guess that goes the way the
last hint said rules numbers out; one that ignores it rules out nothing new), and half is the win.
"""

from __future__ import annotations

import re

LOW, HIGH = 1, 10
_NUMBER = re.compile(r"-?\d+")


class GuessTheNumber:
    """One episode of the game; the secret is the prompt row's ``secret`` column, so a group of episodes of one
    prompt plays the same game (GRPO compares them)."""

    def __init__(self) -> None:
        self.secret = 0
        self.guesses: list[int] = []
        self.won = False

    def reset(self, secret: int, **_: object) -> None:
        """Start a game whose number is ``secret``; the prompt already states the rules."""
        self.secret, self.guesses, self.won = int(secret), [], False

    def step(self, text: str) -> tuple[str | None, None, bool]:
        """Read the model's turn ``text``: its first number is the guess. Reply with the hint (the next user turn),
        or end the episode on a right guess."""
        found = _NUMBER.search(text)
        if found is None:
            return f"Reply with one number from {LOW} to {HIGH}.", None, False
        guess = int(found.group())
        self.guesses.append(guess)
        if guess == self.secret:
            self.won = True
            return None, None, True
        return ("Higher." if guess < self.secret else "Lower."), None, False

    def candidates(self) -> list[int]:
        """The numbers from LOW to HIGH that every hint so far allows (only the secret once the game is won)."""
        if self.won:
            return [self.secret]
        low = max([LOW, *(g + 1 for g in self.guesses if g < self.secret)])
        high = min([HIGH, *(g - 1 for g in self.guesses if g > self.secret)])
        return list(range(low, high + 1))

    def get_reward(self) -> float:
        """Half for the range the hints ruled out (the share of the wrong numbers no longer possible), half for a
        win: 1.0 for any won game, 0.0 for one without a number, in between for a game that narrowed the range."""
        ruled_out = (HIGH - LOW + 1 - len(self.candidates())) / (HIGH - LOW)
        return 0.5 * ruled_out + 0.5 * float(self.won)
