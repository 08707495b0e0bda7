"""The multi-turn environment of examples/agentic_game_smollm2.yaml: guess a number, told "Higher." or "Lower.".

Why this game: every reply of the environment is a user turn that the model has to read (the hint), the episode
ends when the environment says so (a right guess) or at the recipe's ``max_turns``, and the reward is the
environment's own (``get_reward``), so it exercises the whole multi-turn loop (``reset`` / ``step``,
rl/env_steps.py) while a 135M-parameter model can still improve at it within a few dozen CPU steps: answer with
one number in range, then move it the way the hint says.
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

    def get_reward(self) -> float:
        """1 for a game won at the first guess, 0.2 less for each further guess (never below 0.2 for a win); 0 for a
        game not won."""
        if not self.won:
            return 0.0
        return max(0.2, 1.0 - 0.2 * (len(self.guesses) - 1))
