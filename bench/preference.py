"""Preference training's cost, side by side in one run: SFT and DPO steps, and TRL's DPOTrainer.

``python bench/preference.py [--model DIR | --tiny] [--batch 4] [--max-length 0] [--rounds 3] [--steps 3]``

One invocation measures, on the same model, the same pairs and the same batch:

- scaletrain's steps (``bench/contenders/scaletrain_preference.py``, one process, every
  variant compiled once, then timed in bursts, A B C …, one burst per round): an SFT
  step over the same tokens (chosen and rejected rows as one ``[2B, L]`` batch, loss on
  the completion tokens), and a DPO step for each reference-model choice (a frozen copy,
  precomputed reference log-probs, and, with LoRA, the base with its adapters off, next to
  a LoRA SFT step). Per variant: tokens/s counting chosen + rejected tokens (``2·B·L``
  per step), XLA's compiled peak (arguments + temporaries + outputs not aliased) and the
  bytes of the reference weights the state holds.
- TRL 1.16's ``DPOTrainer`` (``bench/contenders/trl_dpo.py``), a new process per round
  started between two of scaletrain's bursts (``--rounds`` rounds, interleaved): pairs/s,
  its process's peak RSS and its reference's bytes.

The pairs are the first ``--batch × --batches`` rows of ``examples/preference/train.jsonl``,
tokenized as TRL 1.16 tokenizes conversational pairs (prompt with the generation prompt;
the completion starts where prompt and prompt+completion diverge); ``--max-length 0`` sets
``L`` to the longest pair rounded up to 16 (TRL gets the same ``max_length`` and pads each
batch to its longest row, as it always does). Writes ``--out`` (default
``bench/results/preference-<date>.json``) and prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)

from common import write_record  # noqa: E402

SMOLLM2 = os.path.join(os.environ.get("SCALETRAIN_CACHE", os.path.expanduser("~/.cache/scaletrain")),
                       "smollm2-135m-instruct")
PAIRS = os.path.join(ROOT, "examples", "preference", "train.jsonl")
OURS = ("sft", "dpo-frozen", "dpo-precomputed", "lora-sft", "lora-dpo-adapters-off")
#: TRL's runs: the reference choice, and ``defaults`` = a frozen copy under DPOConfig's own bf16 and remat defaults
TRL_VARIANTS = ("frozen", "precomputed", "lora", "defaults")
TINY_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def tiny_model(folder: str) -> str:
    """A random 2-layer Llama with the bundled tokenizer and a one-line chat template (plumbing only)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from scaletrain.data import bundled_tokenizer_path

    shutil.copytree(bundled_tokenizer_path(), folder)
    path = os.path.join(folder, "tokenizer_config.json")
    config = json.load(open(path))
    config["chat_template"] = TINY_TEMPLATE
    json.dump(config, open(path, "w"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                                 pad_token_id=0)).save_pretrained(folder)
    return folder


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tokenize_pairs(model_dir: str, rows: list[dict]) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt, chosen, rejected)`` token ids per row, split where TRL 1.16 splits them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def ids(messages: list[dict], gen: bool = False) -> list[int]:
        return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            add_generation_prompt=gen)["input_ids"])

    out = []
    for r in rows:
        prompt, pc, pr = ids(r["prompt"], True), ids(r["prompt"] + r["chosen"]), ids(r["prompt"] + r["rejected"])
        n = min(common_prefix(prompt, pc), common_prefix(prompt, pr))
        out.append((prompt[:n], pc[n:], pr[n:]))
    return out


def pair_arrays(pairs: list[tuple[list[int], list[int], list[int]]], length: int, pad: int) -> dict[str, np.ndarray]:
    """The preference batch keys, right-padded to ``length`` (rows cut to it, keep_start as TRL's default)."""
    out: dict[str, np.ndarray] = {}
    for side, k in (("chosen", 1), ("rejected", 2)):
        ids = np.full((len(pairs), length), pad, np.int32)
        seg = np.zeros((len(pairs), length), np.int32)
        mask = np.zeros((len(pairs), length), np.int32)
        for i, p in enumerate(pairs):
            row = (p[0] + p[k])[:length]
            ids[i, :len(row)], seg[i, :len(row)] = row, 1
            mask[i, len(p[0]):len(row)] = 1
        out |= {f"{side}_input_ids": ids, f"{side}_segment_ids": seg, f"{side}_loss_mask": mask}
    return out


def child_env() -> dict[str, str]:
    """One real CPU device, scaletrain importable from this checkout."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def run_child(cmd: list[str], timeout: float) -> tuple[dict | None, str | None]:
    """Run a contender to completion; (its JSON result, None) or (None, why it failed)."""
    out = cmd[cmd.index("--out") + 1]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f}s"
    if done.returncode != 0 or not os.path.exists(out):
        return None, f"exit {done.returncode}: " + " | ".join((done.stderr or done.stdout).strip().splitlines()[-12:])
    with open(out) as f:
        return json.load(f), None


class Ours:
    """scaletrain's process: compiled once, one timed burst per :meth:`burst` (a line on its stdin)."""

    def __init__(self, spec_path: str, out: str, log: str):
        cmd = [sys.executable, os.path.join(HERE, "contenders", "scaletrain_preference.py"), "--spec", spec_path,
               "--out", out]
        self.out, self.log = out, open(log, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=child_env())
        self._line()  # {"ready": true}: every variant compiled and warm

    def _line(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.flush()
            tail = open(self.log.name).read().strip().splitlines()[-12:]
            raise RuntimeError(f"scaletrain's process exited {self.proc.returncode}: " + " | ".join(tail))
        return json.loads(line)

    def burst(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._line()

    def finish(self) -> dict:
        self.proc.stdin.close()
        if self.proc.wait() != 0:
            raise RuntimeError(f"scaletrain's process exited {self.proc.returncode}")
        self.log.close()
        with open(self.out) as f:
            return json.load(f)


def summarise(ours: list[dict], trl: dict[str, list[dict]], spec: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds; DPO ÷ SFT per reference choice and scaletrain ÷ TRL in pairs/s."""
    tokens = 2 * spec["batch"] * spec["max_length"]
    table: dict[str, Any] = {}
    for name in spec["variants"]:
        if not ours or name not in ours[0]["variants"]:
            continue
        last = ours[0]["variants"][name]
        secs = last["per_round_seconds"]
        s = statistics.median(secs)
        cpu = statistics.median(last["per_round_cpu_seconds"])
        table[name] = {"seconds_per_step": s, "tokens_per_s": tokens / s, "pairs_per_s": spec["batch"] / s,
                       "cpu_seconds_per_step": cpu, "tokens_per_cpu_s": tokens / cpu,
                       "pairs_per_cpu_s": spec["batch"] / cpu,
                       "per_round_tokens_per_s": [tokens / x for x in secs],
                       **{k: last[k] for k in ("compiled_peak_bytes", "params_bytes", "reference_bytes",
                                               "optimizer_bytes", "compile_s", "loss") if k in last}}
    ratios: dict[str, float] = {}
    for dpo, sft in (("dpo-frozen", "sft"), ("dpo-precomputed", "sft"), ("lora-dpo-adapters-off", "lora-sft")):
        if dpo in table and sft in table:
            ratios[f"{dpo}_vs_{sft}"] = table[dpo]["tokens_per_s"] / table[sft]["tokens_per_s"]
            ratios[f"{dpo}_vs_{sft}_per_cpu_s"] = table[dpo]["tokens_per_cpu_s"] / table[sft]["tokens_per_cpu_s"]
    peers: dict[str, Any] = {}
    for variant, results in trl.items():
        if not results:
            continue
        s = statistics.median(r["seconds_per_step"] for r in results)
        cpu = statistics.median(r["cpu_seconds_per_step"] for r in results)
        peers[variant] = {"seconds_per_step": s, "pairs_per_s": spec["batch"] / s, "cpu_seconds_per_step": cpu,
                          "pairs_per_cpu_s": spec["batch"] / cpu,
                          "per_round_pairs_per_s": [r["pairs_per_s"] for r in results],
                          "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
                          "reference_weight_bytes": results[-1]["reference_weight_bytes"],
                          "final_loss": results[-1]["final_loss"], "info": results[-1]["info"]}
    mine = {"frozen": "dpo-frozen", "defaults": "dpo-frozen", "precomputed": "dpo-precomputed",
            "lora": "lora-dpo-adapters-off"}
    for variant, p in peers.items():
        if mine[variant] in table:
            ratios[f"{mine[variant]}_vs_trl_{variant}"] = table[mine[variant]]["pairs_per_s"] / p["pairs_per_s"]
            ratios[f"{mine[variant]}_vs_trl_{variant}_per_cpu_s"] = (table[mine[variant]]["pairs_per_cpu_s"]
                                                                     / p["pairs_per_cpu_s"])
    return {"scaletrain": table, "trl": peers, "ratios": ratios}


def print_table(summary: dict[str, Any], spec: dict[str, Any]) -> None:
    print(f"model {spec['model']}  batch {spec['batch']} pairs  L={spec['max_length']}  "
          f"(tokens/s count 2·B·L chosen + rejected tokens per step)")
    print(f"{'run':<34} {'tokens/s':>9} {'pairs/s':>8} {'pairs/CPU-s':>11} {'peak MB':>9} {'reference MB':>13}")
    for name, r in summary["scaletrain"].items():
        print(f"{'scaletrain ' + name:<34} {r['tokens_per_s']:>9.0f} {r['pairs_per_s']:>8.3f} "
              f"{r['pairs_per_cpu_s']:>11.3f} {r.get('compiled_peak_bytes', 0) / 2**20:>9.0f} "
              f"{r.get('reference_bytes', 0) / 2**20:>13.1f}")
    for name, r in summary["trl"].items():
        print(f"{'TRL DPOTrainer ' + name:<34} {'':>9} {r['pairs_per_s']:>8.3f} {r['pairs_per_cpu_s']:>11.3f} "
              f"{r['peak_rss_mb']:>9.0f} {r['reference_weight_bytes'] / 2**20:>13.1f}  (peak = process RSS)")
    print("ratios: " + ", ".join(f"{k}={v:.3f}" for k, v in summary["ratios"].items()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=SMOLLM2, help="a local HF model folder (default: the converted SmolLM2)")
    p.add_argument("--tiny", action="store_true", help="a random 2-layer model instead (checks the plumbing)")
    p.add_argument("--pairs", default=PAIRS, help="TRL conversational preference JSONL")
    p.add_argument("--batch", type=int, default=4, help="pairs per step (default 4)")
    p.add_argument("--batches", type=int, default=4, help="distinct batches cycled through (default 4)")
    p.add_argument("--max-length", type=int, default=0, help="L; 0: the longest pair rounded up to 16")
    p.add_argument("--steps", type=int, default=3, help="steps per timed burst (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both processes (default 3)")
    p.add_argument("--variants", default=",".join(OURS), help=f"scaletrain's steps, from {OURS}")
    p.add_argument("--trl", default="frozen,defaults", help=f"TRL runs, from {TRL_VARIANTS} ('' for none)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per child process")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    trl_variants = [v for v in a.trl.split(",") if v]
    if bad := [v for v in variants if v not in OURS] + [v for v in trl_variants if v not in TRL_VARIANTS]:
        p.error(f"unknown variant(s) {bad}")
    command = "python bench/preference.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    with tempfile.TemporaryDirectory(prefix="scaletrain-pref-bench-") as work:
        model = tiny_model(os.path.join(work, "tiny")) if a.tiny else a.model
        rows = [json.loads(line) for line in open(a.pairs)][: a.batch * a.batches]
        pairs = tokenize_pairs(model, rows)
        longest = max(len(q) + max(len(c), len(r)) for q, c, r in pairs)
        length = a.max_length or -(-longest // 16) * 16
        pad = json.load(open(os.path.join(model, "config.json"))).get("pad_token_id") or 0
        np.savez(os.path.join(work, "pairs.npz"), **pair_arrays(pairs, length, pad))
        with open(os.path.join(work, "pairs.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        spec = {"model": model, "pairs": os.path.join(work, "pairs.jsonl"), "arrays": os.path.join(work, "pairs.npz"),
                "batch": a.batch, "max_length": length, "steps": a.steps, "warmup": 1, "variants": variants,
                "beta": a.beta, "learning_rate": a.learning_rate, "lora_rank": a.lora_rank,
                "real_tokens_per_pair": float(np.mean([len(q) * 2 + len(c) + len(r) for q, c, r in pairs]))}
        print(f"[preference] {len(rows)} pairs, L={length} (longest {longest}), batch {a.batch}", flush=True)
        trl: dict[str, list[dict]] = {v: [] for v in trl_variants}
        errors: dict[str, str] = {}
        spec_path = os.path.join(work, "spec.json")
        json.dump(spec, open(spec_path, "w"))
        t0 = time.time()
        ours_proc = Ours(spec_path, os.path.join(work, "ours.json"), os.path.join(work, "ours.log")) \
            if variants else None
        print(f"[preference] scaletrain: {len(variants)} steps compiled in {time.time() - t0:.0f}s", flush=True)
        for rnd in range(a.rounds):
            if ours_proc is not None:
                times = ours_proc.burst()
                print(f"[preference] round {rnd + 1} scaletrain: " + ", ".join(
                    f"{v} {times[v + '_wall_s']:.2f}s" for v in variants), flush=True)
            for variant in trl_variants:
                tag = f"trl-{variant}-{rnd}"
                path = os.path.join(work, f"{tag}.spec.json")
                json.dump({**spec, "variant": variant, "gradient_checkpointing": variant == "defaults",
                           "bf16": variant == "defaults",
                           "reference": "frozen" if variant == "defaults" else variant}, open(path, "w"))
                cmd = [sys.executable, os.path.join(HERE, "contenders", "trl_dpo.py"), "--spec", path,
                       "--out", os.path.join(work, f"{tag}.json")]
                res, err = run_child(cmd, a.timeout)
                if err:
                    errors[tag] = err
                    print(f"[preference] round {rnd + 1} TRL {variant}: FAILED {err}", flush=True)
                    continue
                trl[variant].append(res)
                print(f"[preference] round {rnd + 1} TRL {variant}: {res['seconds_per_step']:.2f}s", flush=True)
        ours = [ours_proc.finish()] if ours_proc is not None else []
        summary = summarise(ours, trl, spec)
    print_table(summary, spec)
    record = {"command": command, "spec": {k: v for k, v in spec.items() if k not in ("pairs", "arrays")},
              "rounds": a.rounds, "errors": errors, **summary,
              "machine": {"cpus": os.cpu_count(), "load_after": os.getloadavg()}}
    write_record(record, "preference", a.out)
    return record


if __name__ == "__main__":
    main()
