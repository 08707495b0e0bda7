"""The torch contender of ``bench/gpu.py``: HF transformers' Llama trained the way a torch user would.

``python bench/torch_contender.py --spec JSON --out FILE`` (``bench/gpu.py`` writes the spec: the
architecture dict, batch, seq, packed, steps, window, dtype, compile) trains
``transformers.LlamaForCausalLM`` built from that dict with random weights (``torch.manual_seed(0)``,
constructed directly on the device; no hub), ``attn_implementation="sdpa"``, float32 weights under
``torch.autocast(bfloat16)``, ``torch.optim.AdamW(fused=True)`` where the device has the fused
kernel (else ``foreach``; the result says which) with scaletrain's defaults (betas 0.9/0.95, eps
1e-8, no weight decay, clip 1.0, constant lr 3e-4), and with ``compile`` the whole step (forward,
backward, clip, optimizer) under ``torch.compile`` (inductor). The rows are scaletrain's
(:func:`gpu_cases.case_rows`), the clock the same (:func:`gpu_cases.clock_marks`, a device sync
before each reading), ``first_step_s`` from process start; compile caches are the driver's business
(it starts every run with empty ones).

What SDPA actually gets (checked in transformers 5.17 and 5.23 source and by running both on
torch 2.13 CPU, eager and compiled):

* one sequence per row (``single``, ``long``): ``model(input_ids, labels)`` with HF's defaults.
  Eager: no mask, ``is_causal=True`` (the flash kernel on CUDA). Under ``torch.compile``,
  transformers 5.17 never takes that shortcut while tracing (``_ignore_causal_mask_sdpa``
  returns False), so SDPA gets a materialised ``[B, 1, T, T]`` boolean causal mask (no flash
  kernel); 5.23 with torch 2.13 keeps ``is_causal=True``. This is HF's own behaviour, not ours.
  (``use_cache`` is left at the config's True: with False, the packed-sequence detection below
  runs on the default positions and, compiled, always builds a mask.)
* packed rows: ``position_ids`` restarting at 0 for each document and ``use_cache=False``.
  transformers (``masking_utils.find_packed_sequence_indices``) then reads document starts from
  the positions and builds a block-diagonal causal ``[B, 1, T, T]`` boolean mask for SDPA, eager
  and compiled. ``use_cache=False`` is required: with the default cache the detection is skipped
  and every token attends to all earlier tokens of the row, the other documents included
  (silently). Before training, :func:`packed_attention` compares the mask the installed
  transformers builds with the block-diagonal causal mask of the segment ids; if they differ, the
  run passes that 4-D mask itself and says so in ``info.packed_attention``. Labels are -100 at each
  document's first token, so, as in scaletrain, no token is predicted across a document boundary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import host_memory_gb  # noqa: E402
from gpu_cases import case_rows, clock_marks, process_start_time, steady_rate  # noqa: E402


def block_causal_mask(segments: Any) -> Any:
    """``[B, 1, T, T]`` boolean: query i sees key j iff j <= i and both are in the same document."""
    import torch

    t = segments.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]


def packed_attention(config: Any, positions: Any, segments: Any) -> str:
    """``"position_ids"`` if transformers builds the same-document causal mask from the per-document
    positions (with ``use_cache=False``), else ``"explicit_mask"`` (the run then passes it itself)."""
    import torch
    from transformers.masking_utils import create_causal_mask

    embeds = torch.empty(positions.shape + (1,), dtype=torch.float32)
    built = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                               position_ids=positions)
    if built is not None and built.dtype == torch.bool and torch.equal(built, block_causal_mask(segments)):
        return "position_ids"
    return "explicit_mask"


def make_optimizer(params: list[Any]) -> tuple[Any, str]:
    """AdamW with scaletrain's defaults, fused where the device has the kernel."""
    import torch

    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    try:
        return torch.optim.AdamW(params, fused=True, **kw), "AdamW(fused=True)"
    except (RuntimeError, ValueError) as e:  # no fused kernel for this device / dtype
        return torch.optim.AdamW(params, foreach=True, **kw), f"AdamW(foreach=True): fused unavailable ({e})"


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec['steps']`` steps; tokens/s, first step, memory and losses as a dict."""
    launched = process_start_time()
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch, seq, steps = spec["batch"], spec["seq"], spec["steps"]
    tokens, segments, positions = (torch.from_numpy(a).long() for a in case_rows(spec))
    config = LlamaConfig(**spec["arch"], attn_implementation="sdpa")
    how = packed_attention(config, positions[:batch], segments[:batch]) if spec["packed"] else "causal"
    labels = tokens.masked_fill(positions == 0, -100) if spec["packed"] else tokens
    tokens, labels, segments, positions = (x.to(device) for x in (tokens, labels, segments, positions))

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.train()
    assert all(p.dtype == torch.float32 for p in model.parameters()), "master weights must be float32"
    params = [p for p in model.parameters() if p.requires_grad]
    opt, opt_name = make_optimizer(params)
    compute = getattr(torch, spec["dtype"])

    def step(ids: Any, target: Any, pos: Any, seg: Any) -> Any:
        kw: dict[str, Any] = {}
        if how != "causal":
            kw = dict(position_ids=pos, use_cache=False)
            if how == "explicit_mask":
                kw["attention_mask"] = block_causal_mask(seg)
        with torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32):
            loss = model(input_ids=ids, labels=target, **kw).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    train_step = torch.compile(step) if spec["compile"] else step
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    marks, times, losses = set(clock_marks(steps, spec["window"])), {}, {}
    first_step_s = None
    for s in range(1, steps + 1):
        rows = slice((s - 1) * batch, s * batch)
        loss = train_step(tokens[rows], labels[rows], positions[rows], segments[rows])
        if s in marks:
            sync()
            times[s] = time.perf_counter()
            if s == 1:
                first_step_s = time.time() - launched
                losses[1] = float(loss)
    losses[steps] = float(loss)
    tps, rates = steady_rate(times, batch * seq)
    cuda = device.type == "cuda"
    return {
        "tokens_per_s": tps,
        "window_tokens_per_s": rates,
        "first_step_s": first_step_s,
        "host_peak_rss_gb": host_memory_gb(),
        "device_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "device_memory": ({"max_allocated_bytes": torch.cuda.max_memory_allocated(),
                           "max_reserved_bytes": torch.cuda.max_memory_reserved()} if cuda else {}),
        "first_loss": losses[1],
        "final_loss": losses[steps],
        "num_params": sum(p.numel() for p in model.parameters()),
        "info": {"measured_on": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "attn_implementation": model.config._attn_implementation, "optimizer": opt_name,
                 "compile": bool(spec["compile"]), "autocast": spec["dtype"], "param_dtype": "float32",
                 "packed_attention": how},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="the run as JSON (bench/gpu.py writes it)")
    p.add_argument("--out", required=True, help="result JSON")
    a = p.parse_args(argv)
    result = run(json.loads(a.spec))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
