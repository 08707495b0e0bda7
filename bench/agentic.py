"""Multi-turn rollouts whose rows wait on slow calls: the overlapped loop against turn by turn, side by side.

Why: turn by turn, every turn of every row waits for the slowest row's call, and the engine idles while the
calls run; overlapped (``scaletrain/rl/overlap.py``), a row that waits leaves its slot and the others keep
decoding. Both loops run on the same continuous engine, model, prompts, keys and calls, alternated in one
process (``--repeats`` rounds after one warm-up round each, which compiles), and give the same episodes
(checked here: the bench stops if the token ids differ).

The workload: ``--rows`` chat prompts (bench/rollout_workload.py's), one sample each; between turns each row's
multi-turn environment replies "Go on." to ``--turns`` turns, then ends. Its ``step`` sleeps ``--slow`` seconds
on every ``--slow-every``-th row and ``--fast`` seconds on the others (the calls of a tool; SmolLM2-135M writes no
tool calls, so the work between turns is the environment's, which runs through the same pool and timeout). The
model is the converted SmolLM2-135M-Instruct folder ``--model`` (bench/rollout.py's default; its tests convert it).
Prints and records (``--out``, default bench/results/agentic-<date>.json) the median rollout wall of each loop,
their ratio, the turns a row took and the seconds turn by turn waited on calls.

    python bench/agentic.py --rows 16 --turns 3 --cap 96 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import write_record  # noqa: E402
import rollout_workload as wl  # noqa: E402

DEFAULT_MODEL = os.path.expanduser("~/.cache/scaletrain/smollm2-135m-instruct")


class Talk:
    """A multi-turn environment: "Go on." to ``turns`` model turns, then the end; each ``step`` sleeps ``delay``."""

    def __init__(self, turns: int, delay: float):
        self.turns, self.delay, self.said = turns, delay, 0

    def step(self, action: str) -> Any:
        time.sleep(self.delay)
        self.said += 1
        return None if self.said > self.turns else "Go on."


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--turns", type=int, default=3, help="environment replies per row")
    p.add_argument("--cap", type=int, default=96, help="max_completion_length over the whole trajectory")
    p.add_argument("--slow", type=float, default=1.0)
    p.add_argument("--fast", type=float, default=0.2)
    p.add_argument("--slow-every", type=int, default=4)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import numpy as np
    import transformers

    from scaletrain.generation import SamplingParams
    from scaletrain.generation.continuous import ContinuousBatchEngine
    from scaletrain.models.registry import AutoModelForCausalLM
    from scaletrain.rl.agent_engine import MultiTurnEngine
    from scaletrain.rl.chat_turns import prompt_ids
    from scaletrain.rl.tools import Toolbox

    a = parse(argv)
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype="float32")
    prompts = [prompt_ids(tok, [{"role": "user", "content": wl.CHAT_PROMPTS[r % len(wl.CHAT_PROMPTS)]}], None)
               for r in range(a.rows)]
    sampling = SamplingParams(max_completion_length=a.cap, temperature=a.temperature,
                              stop_token_ids=(int(tok.eos_token_id),), pad_token_id=int(tok.pad_token_id or 0))
    delays = [a.slow if r % a.slow_every == 0 else a.fast for r in range(a.rows)]

    def rollout(overlap: bool, step: int) -> tuple[float, Any, dict[str, int]]:
        inner = ContinuousBatchEngine(sampling, slots=a.slots)
        engine = MultiTurnEngine(inner, tok, lambda n: [], "text", tool_timeout=60.0, overlap=overlap)
        boxes = [Toolbox([], Talk(a.turns, d)) for d in delays]
        start = time.perf_counter()
        out = engine.generate(model, prompts, seed=0, step=step, toolboxes=boxes)
        ids = np.asarray(out.completion_ids)
        return time.perf_counter() - start, (ids, engine.last_episodes), dict(inner.stats)

    walls: dict[str, list[float]] = {"overlapped": [], "turn_by_turn": []}
    turns, waited = [], []
    for step in range(a.repeats + 1):  # step 0 warms up (compiles) both
        (w_o, (ids_o, eps_o), _), (w_t, (ids_t, eps_t), _) = rollout(True, step), rollout(False, step)
        if not np.array_equal(ids_o, ids_t):
            raise SystemExit(f"step {step}: the overlapped rollout's token ids differ from turn by turn's")
        if step:
            walls["overlapped"].append(w_o)
            walls["turn_by_turn"].append(w_t)
            turns.append(float(np.mean([e.turns for e in eps_o])))
            waited.append(max(e.tool_seconds for e in eps_t))
        print(f"step {step}: overlapped {w_o:.2f} s, turn by turn {w_t:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in walls.items()}
    record = dict(bench="agentic", rows=a.rows, turns=a.turns, cap=a.cap, slots=a.slots, slow=a.slow, fast=a.fast,
                  slow_every=a.slow_every, repeats=a.repeats, model=os.path.basename(a.model.rstrip("/")),
                  wall_overlapped_s=med["overlapped"], wall_turn_by_turn_s=med["turn_by_turn"],
                  speedup=med["turn_by_turn"] / med["overlapped"], turns_per_row=statistics.mean(turns),
                  turn_by_turn_wait_s=statistics.median(waited), load=os.getloadavg()[0], walls=walls)
    print(f"overlapped {med['overlapped']:.2f} s vs turn by turn {med['turn_by_turn']:.2f} s: "
          f"{record['speedup']:.2f}x ({record['turns_per_row']:.2f} turns a row; turn by turn waited "
          f"{record['turn_by_turn_wait_s']:.2f} s on calls; load {record['load']:.1f})")
    write_record(record, "agentic", a.out)
    return record


if __name__ == "__main__":
    main()
