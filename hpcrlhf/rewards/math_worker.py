"""The `math` rule's checker: a worker process (`python -m hpcrlhf.rewards.math_worker MEMORY_MB`)
that compares two answers for mathematical equivalence with math-verify.

Request `{"answer": "\\frac{1}{2}", "reference": "0.5"}`: both are read as the content of a
\\boxed{} (LaTeX, or a plain expression), then `math_verify.verify(reference, answer)` (numbers
within its rounding, fractions, percentages, sets, intervals, equations, symbolic equality).
Answer `{"equal": true}`, or `{"unreadable": "reference"}` when the reference reads as nothing.

math-verify's own timeouts are off (`parsing_timeout=None`, `timeout_seconds=None`): they use
SIGALRM, which cannot end the C code a hostile answer runs in (and would replace the caller's
alarm); the job kills this process instead (`hpcrlhf.rewards.workers.WorkerPool`). Its address
space is limited to MEMORY_MB once the imports are done: an answer needing more scores 0.
"""

from __future__ import annotations

import functools
import logging
import resource
import sys

from hpcrlhf.rewards.workers import serve


def limit_memory(megabytes: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    wanted = megabytes << 20
    resource.setrlimit(resource.RLIMIT_AS, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))


def main(argv: list[str]) -> None:
    from math_verify import LatexExtractionConfig, parse, verify  # sympy: in the worker only

    logging.disable(logging.WARNING)  # "Timeout is disabled ...": this process is the timeout
    boxed = [LatexExtractionConfig(boxed_match_priority=0)]

    @functools.lru_cache(maxsize=4096)  # a prompt's reference is checked once per sample
    def read(text: str) -> list:
        return parse("\\boxed{" + text + "}", extraction_config=boxed, parsing_timeout=None)

    def handle(request: dict) -> dict:
        reference = read(request["reference"])
        if not reference:
            return {"unreadable": "reference"}
        answer = read(request["answer"])
        return {"equal": bool(answer) and verify(reference, answer, timeout_seconds=None)}

    limit_memory(int(argv[1]))
    serve(handle)


if __name__ == "__main__":
    main(sys.argv)
