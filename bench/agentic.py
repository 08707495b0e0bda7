"""Multi-turn rollouts whose rows wait on slow calls: the overlapped loop against turn by turn, side by side.

Why: turn by turn, every turn of every row waits for the slowest row's call, and the engine idles while the
calls run; overlapped (``scaletrain/rl/overlap.py``), a row that waits leaves its slot and the others keep
decoding, and keeps its pages, so its next turn prefills only its new tokens. Three contenders run on the same
continuous engine, model, prompts, keys and calls, alternated in one process (``--repeats`` rounds after one
warm-up round each, which compiles): overlapped with kept pages, overlapped with every turn prefilled from
scratch (``keep_pages=False``), and turn by turn. The last two run the same programs and give the same episodes
(checked here: the bench stops if their token ids differ). With kept pages a turn's prefix keys come from other
programs (decode, a chunk), so its log-probabilities differ in the last bits and, where a sampled token sits at a
near-tie of the inverse CDF, a token may differ: the bench counts the rows whose ids differ from the re-prefilled
rollout's and the largest log-prob gap before each row's first differing token.

The workload: ``--rows`` chat prompts (bench/rollout_workload.py's), one sample each; between turns each row's
multi-turn environment replies "Go on." to ``--turns`` turns, then ends. Its ``step`` sleeps ``--slow`` seconds
on every ``--slow-every``-th row and ``--fast`` seconds on the others (the calls of a tool; SmolLM2-135M writes no
tool calls, so the work between turns is the environment's, which runs through the same pool and timeout). The
model is the converted SmolLM2-135M-Instruct folder ``--model`` (bench/rollout.py's default; its tests convert it).
Prints and records (``--out``, default bench/results/agentic-<date>.json) the median rollout wall and process
CPU-seconds of each contender, their ratios, the turns a row took, the seconds turn by turn waited on calls, and
the kept-page figures of the overlapped run (turns resumed over kept pages, context tokens not prefilled again,
kept pages given back to a short pool).

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


def gap(kept: list[Any], whole: list[Any]) -> dict[str, float]:
    """How the kept-pages episodes differ from the re-prefilled ones: rows whose ids differ, where the first
    differing token sits in them (the model's tokens), and the largest log-prob gap before it (over every row)."""
    import numpy as np

    rows, first, worst = 0, [], 0.0
    for a, b in zip(kept, whole):
        n = next((i for i, (x, y) in enumerate(zip(a.completion_ids, b.completion_ids)) if x != y), None)
        if n is not None or len(a.completion_ids) != len(b.completion_ids):
            rows += 1
            first.append(n)
        m = min(len(a.log_probs), len(b.log_probs)) if n is None else n
        if m:
            worst = max(worst, float(np.abs(np.asarray(a.log_probs[:m]) - np.asarray(b.log_probs[:m])).max()))
    return dict(rows_differing=rows, first_differing=first, lp_gap_max=worst)


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

    def rollout(name: str, step: int) -> tuple[float, float, Any, dict[str, int]]:
        inner = ContinuousBatchEngine(sampling, slots=a.slots, keep_pages=name == "overlapped")
        engine = MultiTurnEngine(inner, tok, lambda n: [], "text", tool_timeout=60.0, overlap=name != "turn_by_turn")
        boxes = [Toolbox([], Talk(a.turns, d)) for d in delays]
        start, cpu = time.perf_counter(), time.process_time()
        out = engine.generate(model, prompts, seed=0, step=step, toolboxes=boxes)
        ids = np.asarray(out.completion_ids)
        return (time.perf_counter() - start, time.process_time() - cpu, (ids, engine.last_episodes),
                dict(inner.stats))

    names = ("overlapped", "overlapped_reprefill", "turn_by_turn")
    walls: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}
    turns, waited, kept = [], [], []
    for step in range(a.repeats + 1):  # step 0 warms up (compiles) every contender
        runs = {n: rollout(n, step) for n in names}
        if not np.array_equal(runs["turn_by_turn"][2][0], runs["overlapped_reprefill"][2][0]):
            raise SystemExit(f"step {step}: the overlapped rollout's token ids differ from turn by turn's")
        differ = gap(runs["overlapped"][2][1], runs["overlapped_reprefill"][2][1])
        if step:
            for n in names:
                walls[n].append(runs[n][0])
                cpus[n].append(runs[n][1])
            turns.append(float(np.mean([e.turns for e in runs["overlapped"][2][1]])))
            waited.append(max(e.tool_seconds for e in runs["turn_by_turn"][2][1]))
            stats, plain = runs["overlapped"][3], runs["overlapped_reprefill"][3]
            figures = ("prefills", "prefills_resumed", "kept_prefix_tokens", "kept_dropped", "peak_pages", "num_pages",
                       "preemptions")
            kept.append(differ | {k: stats[k] for k in figures}
                        | {"reprefill_peak_pages": plain["peak_pages"], "reprefill_preemptions": plain["preemptions"]})
        print(f"step {step}: {differ}; " + ", ".join(f"{n} {runs[n][0]:.2f} s / {runs[n][1]:.2f} CPU-s" for n in names),
              flush=True)
    med = {k: statistics.median(v) for k, v in walls.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    record = dict(bench="agentic", rows=a.rows, turns=a.turns, cap=a.cap, slots=a.slots, slow=a.slow, fast=a.fast,
                  slow_every=a.slow_every, repeats=a.repeats, model=os.path.basename(a.model.rstrip("/")),
                  wall_overlapped_s=med["overlapped"], wall_overlapped_reprefill_s=med["overlapped_reprefill"],
                  wall_turn_by_turn_s=med["turn_by_turn"], cpu_s=cpu,
                  speedup=med["turn_by_turn"] / med["overlapped"],
                  kept_speedup=med["overlapped_reprefill"] / med["overlapped"],
                  kept_cpu_ratio=cpu["overlapped_reprefill"] / cpu["overlapped"], kept=kept,
                  turns_per_row=statistics.mean(turns), turn_by_turn_wait_s=statistics.median(waited),
                  load=os.getloadavg()[0], walls=walls, cpus=cpus)
    print(f"overlapped {med['overlapped']:.2f} s ({cpu['overlapped']:.2f} CPU-s) vs re-prefilled "
          f"{med['overlapped_reprefill']:.2f} s ({cpu['overlapped_reprefill']:.2f} CPU-s): kept pages "
          f"{record['kept_speedup']:.2f}x wall, {record['kept_cpu_ratio']:.2f}x CPU; vs turn by turn "
          f"{med['turn_by_turn']:.2f} s: {record['speedup']:.2f}x ({record['turns_per_row']:.2f} turns a row; turn by "
          f"turn waited {record['turn_by_turn_wait_s']:.2f} s on calls; load {record['load']:.1f}); kept: {kept[-1]}")
    write_record(record, "agentic", a.out)
    return record


if __name__ == "__main__":
    main()
