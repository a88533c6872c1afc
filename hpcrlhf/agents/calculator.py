"""The bundled calculator task's environment (`task.name: calculator`): the model is asked a product
of two two-digit numbers, may call `multiply`, and its answer without a call is judged (reward 1 when
it is the product: "= 2183"). It is written as a user's environment would be (`agent.environment:
hpcrlhf.agents.calculator:Calculator`)."""

from __future__ import annotations

from hpcrlhf.agents.contract import Step, tool
from hpcrlhf.data.tasks import CalculatorTask


class Calculator:
    def __init__(self) -> None:
        self.task = CalculatorTask()
        self.prompt = ""

    def reset(self, row: dict, seed: int) -> str:
        self.prompt = row["prompt"]
        return self.prompt

    @tool
    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return a * b

    def step(self, action: str) -> Step:
        correct = self.task.score(self.prompt, action) == 1.0
        return Step(None, float(correct), True, {"success": correct})
