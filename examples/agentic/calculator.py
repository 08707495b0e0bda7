"""The tool environment of examples/agentic/tools_smollm2.yaml: a calculator whose methods are the model's tools.

Why an environment and not bare tools: TRL's ``environment_factory`` contract gives each rollout row its own
instance, so the environment can see the row's ``answer`` (``reset``) and what the model asked of it, and score the
episode itself (``get_reward``): 1 when a call returned the answer, so the model is paid for using the tool right
even before it learns to repeat the result. ``exact_answer`` (the recipe's other reward) pays the final reply.
"""

from __future__ import annotations


class Calculator:
    """A calculator for one episode: ``add`` and ``multiply`` are its tools."""

    def __init__(self) -> None:
        self.answer: str | None = None
        self.results: list[int] = []

    def reset(self, answer: str, **_: object) -> None:
        """Start an episode whose correct result is ``answer`` (the prompt row's column); nothing is added to the
        prompt."""
        self.answer = str(answer)
        self.results = []

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.results.append(int(a) + int(b))
        return self.results[-1]

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.results.append(int(a) * int(b))
        return self.results[-1]

    def get_reward(self) -> float:
        """1.0 when one of the episode's calls returned the correct result, else 0.0."""
        return float(self.answer is not None and self.answer in {str(r) for r in self.results})
