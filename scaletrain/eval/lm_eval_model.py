"""``ScaletrainLM``: an lm-evaluation-harness model backed by a scaletrain model (registered as ``scaletrain``).

Why a model class of our own rather than an export to transformers: the model is scored
where it was trained (any family, any mesh, LoRA adapters applied unmerged), straight from
a run's checkpoint, and faster than lm-eval's ``hf`` model: requests are batched into a few
padded shapes and scored by one jitted forward each (:mod:`scaletrain.eval.scorer`).
Tokenisation follows lm-eval's ``TemplateLM`` (the context/continuation split, the prefix
token for an empty context) so the requests are the ones its ``hf`` model scores.

This module imports ``lm_eval``: ``import scaletrain`` never imports it (lm-eval is the
``eval`` extra); :func:`scaletrain.eval.harness.require_lm_eval` says how to install it.
"""

from __future__ import annotations

from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm.auto import tqdm

from scaletrain.errors import ConfigError
from scaletrain.eval.scorer import TokenScorer, bucket

#: lm-eval's own default for ``max_gen_toks`` (its ``hf`` model's)
MAX_GEN_TOKS = 256


@register_model("scaletrain")
class ScaletrainLM(TemplateLM):
    """lm-eval's ``LM`` over a scaletrain model: ``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``.

    From Python: ``ScaletrainLM(model=..., tokenizer=...)`` or ``ScaletrainLM(pretrained=PATH)`` (a run
    folder, a checkpoint or an HF folder; ``checkpoint=N``, ``adapter=DIR``, ``mesh=(1, -1, 1, 1, 1)``), then
    ``lm_eval.simple_evaluate(model=lm, tasks=[...])``; from lm-eval's own command line
    ``--model scaletrain --model_args pretrained=PATH``.
    """

    def __init__(self, model: Any = None, tokenizer: Any = None, *, pretrained: str | None = None,
                 checkpoint: int | None = None, adapter: str | None = None, mesh: Any = None,
                 batch_size: int | str | None = 8, max_length: int | None = None, max_gen_toks: int = MAX_GEN_TOKS,
                 add_bos_token: bool | None = None, template_name: str | None = None, **_ignored: Any):
        super().__init__()
        if (model is None) == (pretrained is None):
            raise ConfigError("ScaletrainLM: pass model= (with tokenizer=) or pretrained=PATH, one of the two")
        self.name = pretrained or type(model).__name__
        if pretrained is not None:
            from scaletrain.eval.targets import load_target

            loaded = load_target(pretrained, step=None if checkpoint is None else int(checkpoint), adapter=adapter,
                                 mesh=mesh)
            model, tokenizer = loaded.model, tokenizer or loaded.tokenizer
        if tokenizer is None:
            raise ConfigError(f"{self.name}: lm-eval tasks are text; the model has no tokenizer saved beside it")
        self.tokenizer = tokenizer
        self.add_bos_token = add_bos_token
        size = 8 if batch_size in (None, "auto") else int(str(batch_size).split(":")[0])
        self.scorer = TokenScorer(model, size, max_length)
        self._max_gen_toks = int(max_gen_toks)
        self.template_name = template_name  # --apply_chat_template NAME: one of the tokenizer's named templates

    # ---- what TemplateLM asks of a model -------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context is conditioned on: bos if there is one, else eos (as lm-eval's hf model)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def batch_size(self) -> int:
        return self.scorer.batch_size

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "tokenizer").replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat as the tokenizer's template renders it (``--apply_chat_template``), as lm-eval's ``hf`` model
        renders it: the last assistant turn continued when no generation prompt is asked, and a template that
        rejects a system turn tried again without it."""
        import jinja2

        from scaletrain.data.chat_templates import apply_chat_template

        templates = getattr(self.tokenizer, "chat_template", None)
        named = isinstance(templates, dict) and self.template_name in templates
        keys = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                    continue_final_message=not add_generation_prompt,
                    **({"chat_template": self.template_name} if named else {}))
        try:
            return apply_chat_template(self.tokenizer, chat_history, **keys)
        except jinja2.exceptions.TemplateError:
            return apply_chat_template(self.tokenizer, [m for m in chat_history if m["role"] != "system"], **keys)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``; the tokenizer's own special tokens unless told (a string that already starts
        with the bos text gets none, so bos is never doubled)."""
        flag = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        bos = getattr(self.tokenizer, "bos_token", None)
        if add_special_tokens is None and bos and string.startswith(bos):
            flag = False
        kw = {} if flag is None else {"add_special_tokens": flag}
        return list(self.tokenizer.encode(string, **kw))

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """Each ``(context tokens, continuation tokens)`` scored in the scorer's batches and shape buckets."""
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood requests")
        out = self.scorer.score([(ctx + cont, len(cont)) for _, ctx, cont in requests], bar)
        bar.close()
        for (pair, _, _), answer in zip(requests, out):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood in windows of ``max_length`` (lm-eval's own windowing), all windows of all
        requests scored together."""
        windows: list[tuple[int, list[int], list[int]]] = []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((i, ctx, cont))
        bar = tqdm(total=len(windows), disable=disable_tqdm, desc="loglikelihood_rolling windows")
        scores = self.scorer.score([(ctx + cont, len(cont)) for _, ctx, cont in windows], bar)
        bar.close()
        totals = [0.0] * len(requests)
        for (i, _, _), (logp, _) in zip(windows, scores):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, as ``gen_kwargs`` say) continuations cut at the first stop sequence.

        Requests with the same ``gen_kwargs`` are batched; prompts are left-padded to a bucket length and the
        batch filled to ``batch_size`` rows, so each (bucket, max_gen_toks) compiles once.
        """
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out = [""] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until requests")
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self._max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise ConfigError(f"max_gen_toks={max_new} leaves no room for a prompt in max_length="
                                  f"{self.max_length}")
            prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):] for i in members}
            ordered = sorted(members, key=lambda i: -len(prompts[i]))
            for lo in range(0, len(ordered), self.batch_size):
                chosen = ordered[lo: lo + self.batch_size]
                texts = self._generate([prompts[i] for i in chosen], max_new, kwargs)
                for i, text in zip(chosen, texts):
                    out[i] = postprocess_generated_text(text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
                bar.update(len(chosen))
        bar.close()
        return out

    def _generate(self, prompts: list[list[int]], max_new: int, kwargs: dict[str, Any]) -> list[str]:
        import jax
        import numpy as np

        from scaletrain.generation import generate, until_stop

        width = bucket(max(len(p) for p in prompts), self.max_length - max_new)
        rows = self.batch_size
        ids = np.zeros((rows, width), np.int32)
        mask = np.zeros((rows, width), np.int32)
        for j in range(rows):
            p = prompts[min(j, len(prompts) - 1)]
            ids[j, width - len(p):], mask[j, width - len(p):] = p, 1
        sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
        with jax.set_mesh(self.scorer.mesh):
            new = generate(self.scorer.model, ids, attention_mask=mask, max_new_tokens=max_new,
                           temperature=float(kwargs.get("temperature") or 0.0) if sample else 0.0,
                           top_k=kwargs.get("top_k") if sample else None, top_p=kwargs.get("top_p") if sample else None,
                           seed=int(kwargs.get("seed") or 0), eos_token_id=[self.eot_token_id])
        return [self.tok_decode(until_stop(row, [self.eot_token_id])) for row in new[: len(prompts)]]

    def get_model_info(self) -> dict[str, Any]:
        """Recorded in lm-eval's results file beside its own configuration."""
        import jax

        config = self.scorer.model.config
        return {"model_num_parameters": int(config.num_params), "model_dtype": str(self.scorer.model.dtype),
                "scaletrain_model": self.name, "scaletrain_mesh": dict(self.scorer.mesh.shape),
                "scaletrain_devices": jax.device_count()}
