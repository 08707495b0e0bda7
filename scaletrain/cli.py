"""``scaletrain`` command line: ``train``, ``launch``, ``sweep``, ``generate``, ``eval``, ``export`` and ``plot``.

User errors (:class:`ScaletrainError`) print one message and exit with status 2; Ctrl-C
outside training (which stops at a checkpoint instead) prints one line and exits with 130;
anything else is a bug and keeps its traceback. A process of a multi-process job that fails
leaves at once (:func:`leave_job`), so that the launcher sees it and stops the others.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from scaletrain import __version__
from scaletrain.errors import ScaletrainError
from scaletrain.logs import setup_logging


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain", description="Train language models in JAX.")
    p.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train as a YAML recipe says")
    t.add_argument("recipe", help="path to the recipe YAML")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_training_steps=50")
    t.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (jax.distributed; docs/launch.md)")
    t.add_argument("--num-processes", type=int, default=None, help="processes in the job (jax.distributed)")
    t.add_argument("--process-id", type=int, default=None, help="this process's id, 0..N-1 (jax.distributed)")
    la = sub.add_parser("launch", help="run a recipe as N processes of one jax.distributed job on this host")
    la.add_argument("recipe", help="path to the recipe YAML")
    la.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_training_steps=50")
    la.add_argument("--nproc", type=int, required=True, help="processes to start (one per accelerator)")
    la.add_argument("--kill-after", type=float, default=30.0,
                    help="seconds the other processes get after one fails, before they are killed (default 30)")
    sw = sub.add_parser("sweep", help="a scaling ladder: one training per scaling index, in parallel on Ray")
    sw.add_argument("recipe", help="path to the recipe YAML")
    sw.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_training_steps=50")
    sw.add_argument("--scaling-indices", default=None, help="comma-separated, e.g. 1,2,4,8 (default: sweep.scaling_indices)")
    sw.add_argument("--address", default=None, help="Ray address ('auto' joins a running cluster; default: start one)")
    sw.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of a local Ray instance")
    sw.add_argument("--rerun-changed", action="store_true",
                    help="re-run members whose resolved recipe changed (their old folder is moved aside, not deleted)")
    g = sub.add_parser("generate", help="continue prompts with a Hugging Face model folder or a training run")
    g.add_argument("model_dir", help="an HF folder, a PEFT adapter folder (its base from adapter_config.json), "
                                     "or a run folder (its newest checkpoint) or one step folder")
    g.add_argument("--checkpoint", type=int, default=None, help="run folders: the step (default: the newest)")
    which = g.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="one prompt; its continuation is printed")
    which.add_argument("--prompts", metavar="FILE",
                       help="several prompts, the model loaded once: one a line, or JSONL rows with 'prompt' (text "
                            "or messages) or 'messages'; prints one JSON line per prompt, in order")
    g.add_argument("--batch-size", type=int, default=16, help="--prompts: prompts per engine call (default 16)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn (chat template)")
    _eval_parser(sub)
    e = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face folder")
    e.add_argument("run_dir", help="run folder, its checkpoints folder, or one step folder")
    e.add_argument("--checkpoint", type=int, default=None, help="step (default: the newest)")
    e.add_argument("--out", required=True)
    e.add_argument("--max-shard-size", default="2GB")
    e.add_argument("--merge", action="store_true",
                   help="LoRA runs: write the full model with the adapters merged (default: a PEFT adapter folder)")
    pl = sub.add_parser("plot", help="draw loss, learning rate and throughput of a run into a PNG")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None)
    pl.add_argument("--metric", default=None, help="draw this logged figure alone (reward, kl, rewards/NAME/mean, "
                    "...) with its running mean; default: loss, learning rate, throughput (and reward)")
    return p


#: ``data`` section keys ``eval`` takes as options (``--text-column`` ...)
DATA_KEYS = ("text_column", "messages_column", "format", "chat_template", "prompt_column", "chosen_column",
             "rejected_column", "completion_column", "label_column")


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    """``eval``: lm-eval's own flag names are accepted as they spell them (``--include_path``) and dashed."""
    ev = sub.add_parser("eval", help="evaluate a run, checkpoint or HF folder: loss on data, lm-eval tasks")
    ev.add_argument("target", help="a run folder (its newest checkpoint), a checkpoint folder or an HF folder")
    ev.add_argument("--checkpoint", type=int, default=None, help="run folders: the step (default: the newest)")
    ev.add_argument("--adapter", default=None, help="a PEFT adapter folder to apply to an HF TARGET")
    ev.add_argument("--mesh", default=None, help="mesh axis sizes dp,fsdp,ep,tp,sp (default: all devices on fsdp)")
    ev.add_argument("--data", default=None, help="a data source to score (default for a run: its own eval data)")
    ev.add_argument("--kind", default="pretrain", help="the data kind (pretrain, chat, preference, ...)")
    ev.add_argument("--objective", default=None, choices=("dpo", "kto", "orpo", "simpo", "reward"),
                    help="preference data: the objective (default: the run's; reward for a reward model's folder; "
                         "dpo, or kto for unpaired)")
    ev.add_argument("--beta", type=float, default=None, help="preference data: the objective's beta")
    ev.add_argument("--reference", default=None,
                    help="preference data: the reference model folder (DPO, KTO; default: the run's, or the base "
                         "with adapters off)")
    ev.add_argument("--split", default="train", help="the split of a Hugging Face dataset folder")
    for key in DATA_KEYS:
        ev.add_argument(f"--{key.replace('_', '-')}", dest=key, default=None)
    ev.add_argument("--max-length", type=int, default=None, help="row length (default: the run's, else 2048 at most)")
    ev.add_argument("--max-batches", type=int, default=None, help="score at most this many batches")
    ev.add_argument("--output", default=None, help="write the figures as JSON here")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.add_argument("--tasks", default=None, help="lm-eval tasks, comma-separated (names or YAML files)")
    ev.add_argument("--include-path", "--include_path", dest="include_path", default=None,
                    help="a folder of your own lm-eval task YAMLs")
    ev.add_argument("--output-path", "--output_path", dest="output_path", default=None,
                    help="where lm-eval writes its results_*.json (and samples_*.jsonl)")
    ev.add_argument("--log-samples", "--log_samples", dest="log_samples", action="store_true")
    ev.add_argument("--limit", type=float, default=None, help="at most N examples per task (a fraction if < 1)")
    ev.add_argument("--num-fewshot", "--num_fewshot", dest="num_fewshot", type=int, default=None)
    ev.add_argument("--apply-chat-template", "--apply_chat_template", dest="apply_chat_template", nargs="?",
                    const=True, default=False, metavar="TEMPLATE",
                    help="lm-eval tasks: render prompts with the tokenizer's chat template (optionally a template "
                         "name, for a tokenizer that has several), as lm-eval's own flag")
    ev.add_argument("--fewshot-as-multiturn", "--fewshot_as_multiturn", dest="fewshot_as_multiturn", nargs="?",
                    const=True, default=None, type=lambda x: x.lower() in ("true", "1", "yes"), metavar="BOOL",
                    help="lm-eval tasks: few-shot examples as turns of the chat (on by default with "
                         "--apply_chat_template; 'false' turns it off), as lm-eval's own flag")
    ev.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int, default=None,
                    help="rows per batch (default: the run's; 8 for lm-eval requests and HF folders)")


def cmd_train(ns: argparse.Namespace) -> int:
    from scaletrain.launch.backends import run_recipe
    from scaletrain.recipe import Recipe

    # the address quoted: YAML would read some HOST:PORT spellings as numbers
    flags = {"coordinator_address": ns.coordinator and f"'{ns.coordinator}'", "num_processes": ns.num_processes,
             "process_id": ns.process_id}
    recipe = Recipe.load(ns.recipe, [*ns.overrides, *(f"launch.{k}={v}" for k, v in flags.items() if v is not None)])
    summary = run_recipe(recipe)
    keys = ("final_step", "final_train_loss", "final_eval_loss", "final_eval_bits_per_byte", "tokens_per_s", "mfu")
    print("\n".join(f"{k:26s} {summary.get(k)}" for k in keys))
    if "sample" in summary:
        print("\n--- sample ---\n" + summary["sample"] + "\n--------------")
    return 0


def cmd_launch(ns: argparse.Namespace) -> int:
    from scaletrain.launch.jax.supervisor import launch_processes

    return launch_processes(ns.recipe, ns.overrides, ns.nproc, kill_after=ns.kill_after)


def cmd_sweep(ns: argparse.Namespace) -> int:
    from scaletrain.sweep.ladder import run_sweep
    from scaletrain.errors import ConfigError
    from scaletrain.recipe import Recipe

    recipe = Recipe.load(ns.recipe, ns.overrides)
    indices = None
    if ns.scaling_indices:
        try:
            indices = [int(x) for x in ns.scaling_indices.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--scaling-indices {ns.scaling_indices!r}: use comma-separated ints like 1,2,4,8") from None
    report = run_sweep(recipe, indices, ray_address=ns.address, num_cpus=ns.num_cpus,
                       rerun_changed=ns.rerun_changed)
    print(f"{'index':>5} {'status':28s} {'params':>10} {'FLOPs':>10} {'eval loss':>9}")
    for r in report["members"]:
        loss = r.get("final_eval_loss")
        print(f"{r['scaling_index']:>5} {r['status']:28s} {r.get('num_params') or '':>10} "
              f"{(format(r['flops'], '.3g') if r.get('flops') else ''):>10} "
              f"{(format(loss, '.4f') if loss is not None else ''):>9}"
              + (f"  {r['error']}" if r.get("error") else ""))
    fit = report["fit"]
    print(f"fit: L = {fit['a']:.4g} * C^-{fit['b']:.4g} + {fit['c']:.4g}" if fit.get("ok") else f"fit: {fit['reason']}")
    print(f"wrote {os.path.join(report['sweep_dir'], 'sweep.json')}, sweep.csv, sweep.png")
    failed = [r["scaling_index"] for r in report["members"] if r["status"] == "failed"]
    if failed:
        print(f"scaletrain: {len(failed)} member(s) failed: {failed}; fix and re-run to train only those", file=sys.stderr)
        return 1
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    import json

    from scaletrain.cli_hf import continue_prompts, load_for_generation, read_prompts
    from scaletrain.errors import ConfigError
    from scaletrain.generation import sampling_problem

    if problem := sampling_problem(ns.max_new_tokens, ns.temperature, ns.top_k, ns.top_p):
        name, what = problem
        raise ConfigError(f"--{name.replace('_', '-')} {what}")  # before the model loads
    if ns.batch_size < 1:
        raise ConfigError(f"--batch-size {ns.batch_size}: must be >= 1")
    prompts = [ns.prompt] if ns.prompts is None else read_prompts(ns.prompts)  # a bad file: before the model loads
    model, tokenizer = load_for_generation(ns.model_dir, step=ns.checkpoint)
    texts = continue_prompts(model, tokenizer, prompts, max_new_tokens=ns.max_new_tokens, temperature=ns.temperature,
                             top_k=ns.top_k, top_p=ns.top_p, seed=ns.seed, chat=ns.chat, batch_size=ns.batch_size)
    if ns.prompts is None:
        sys.stdout.write(texts[0] if texts[0].endswith("\n") else texts[0] + "\n")  # one final newline, never two
    else:
        sys.stdout.writelines(json.dumps({"prompt": p, "completion": t}, ensure_ascii=False) + "\n"
                              for p, t in zip(prompts, texts))
    sys.stdout.flush()
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from scaletrain.eval_command import format_table, parse_mesh, run_eval, write_json
    from scaletrain.eval_preference import PreferenceOptions

    if ns.limit is not None and ns.limit >= 1:
        ns.limit = int(ns.limit)
    report = run_eval(
        ns.target, data=ns.data, kind=ns.kind, split=ns.split,
        data_keys={k: getattr(ns, k) for k in DATA_KEYS},
        tasks=ns.tasks, include_path=ns.include_path, output_path=ns.output_path, log_samples=ns.log_samples,
        limit=ns.limit, num_fewshot=ns.num_fewshot, apply_chat_template=ns.apply_chat_template,
        fewshot_as_multiturn=ns.fewshot_as_multiturn, batch_size=ns.batch_size, max_length=ns.max_length,
        max_batches=ns.max_batches, checkpoint=ns.checkpoint, adapter=ns.adapter, mesh=parse_mesh(ns.mesh),
        progress=not ns.no_progress,
        preference=PreferenceOptions(objective=ns.objective, beta=ns.beta, reference=ns.reference),
    )
    if "lm_eval_results" in report:
        from lm_eval.utils import make_table

        print(make_table(report["lm_eval_results"]))
    print(format_table(report))
    if ns.output:
        print(f"wrote {write_json(report, ns.output)}")
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from scaletrain.export import export_checkpoint

    print(export_checkpoint(ns.run_dir, ns.out, step=ns.checkpoint, max_shard_size=ns.max_shard_size,
                            merge=ns.merge))
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    from scaletrain.plot import plot_run

    print(plot_run(ns.run_dir, ns.out, metric=ns.metric))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        status = _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before training took over SIGINT (while importing, tokenizing, ...)
        print("\nscaletrain: interrupted", file=sys.stderr)
        status = 130
    except Exception:
        if in_multiprocess_job():
            traceback.print_exc()
            leave_job(1)
        raise
    if status and in_multiprocess_job():
        leave_job(status)
    return status


def in_multiprocess_job() -> bool:
    """Whether this process joined a jax.distributed job of several processes (jax not imported: no)."""
    if "jax" not in sys.modules:
        return False
    import jax

    return jax.process_count() > 1


def leave_job(status: int) -> None:
    """Exit now with ``status``, skipping the interpreter's exit hooks.

    Why: jax.distributed's exit hook waits at a barrier for every process of the job, and a
    process that failed alone (a bug, a user error only it saw) would wait there forever while
    the others wait for it inside a collective: the whole job would hang instead of failing.
    Leaving without the hooks lets ``scaletrain launch`` (or Slurm) see the failure and stop the
    others. Nothing saved is lost: checkpoints are complete before they count.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _main(argv: list[str] | None) -> int:
    if argv is None:  # a real command line (not a call from Python): restart with huge pages if useful
        from scaletrain.host_memory import reexec_with_hugepages

        reexec_with_hugepages()
    parser = _parser()
    ns, extra = parser.parse_known_args(argv)
    # overrides may also follow options (`sweep R --scaling-indices 1,2 training.x=1`)
    if extra and getattr(ns, "overrides", None) is not None and not any(x.startswith("-") for x in extra):
        ns.overrides = [*ns.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    setup_logging()
    commands = {"train": cmd_train, "launch": cmd_launch, "sweep": cmd_sweep, "generate": cmd_generate,
                "eval": cmd_eval, "export": cmd_export, "plot": cmd_plot}
    try:
        return commands[ns.command](ns)
    except (ScaletrainError, OSError) as err:
        status = report_user_error(err)
        if status is None:
            raise
        return status


def report_user_error(err: BaseException) -> int | None:
    """Print a user error as one line on stderr and return its exit status (2); None for a bug.

    User errors are :class:`ScaletrainError` and a write refused for lack of room, wherever
    it was (checkpoint, metrics, summary): the user's to fix by freeing space. A bug keeps
    its traceback (the caller re-raises). Scripts that drive a Trainer may call this too.
    """
    from scaletrain.training.disk_full import no_room

    if isinstance(err, ScaletrainError):
        if not getattr(err, "reported", False):  # a reward error one process of several said as it happened
            print(f"scaletrain: error: {err}", file=sys.stderr)
        return 2
    reason = no_room(err) if isinstance(err, OSError) else None
    if reason is None:
        return None
    print(f"scaletrain: error: cannot write {err.filename or 'to the output folder'} ({reason}); free space "
          "or move training.output_dir, then resume with training.resume_if_possible=true", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
