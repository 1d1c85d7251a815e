"""The ModelConfig the command line asks for: a preset with overrides, the model of a
Hugging Face directory or of an imported checkpoint, and the document mask the data
allows."""
from __future__ import annotations

import dataclasses

from engine.cli.oneline import UsageError
from engine.config import model_config, resolve_activations

MODEL_FLAGS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "vocab",
               "experts", "top_k", "shared_experts", "capacity_factor")



def model_from_flags(args):
    """The ModelConfig the flags ask for: a preset with overrides, or the model of
    --init-from-hf (or of a resumed checkpoint imported from Hugging Face, without
    --model) with the numerics flags; `args.hf` is then that model's HF record
    ({config, source}) for the checkpoints, else None."""
    numerics = dict(dtype=args.dtype, remat=args.remat, attention=args.attention,
                    activations=resolve_activations(args.activations,
                                                    getattr(args, "hardware", None)))
    args.hf, args.model_name = None, args.model or "small"
    base = None
    if getattr(args, "init_from_hf", None):
        from engine.hf import families
        from engine.hf.io import HFError

        if args.resume:
            raise UsageError("--init-from-hf starts a run at step 0; --resume continues one "
                             "(a checkpoint imported by engine.convert resumes without it)")
        try:
            hf = families.read_config(args.init_from_hf)
            base = families.model_config(hf, args.vocab_multiple, **numerics)
        except HFError as e:
            raise UsageError(str(e)) from None
        args.hf, args.model_name = dict(config=hf, source=args.init_from_hf), "from-hf"
    elif args.resume and args.checkpoint_dir and args.model is None:
        base = imported_model(args, numerics)
    if base is None:
        return model_config(args.model_name, **{k: getattr(args, k) for k in MODEL_FLAGS},
                            **numerics)
    if args.model is not None:
        raise UsageError(f"--model {args.model} and the model of {args.model_name} "
                         f"conflict; drop --model")
    clash = [f"--{k.replace('_', '-')} {getattr(args, k)} (config: {getattr(base, k)})"
             for k in MODEL_FLAGS if getattr(args, k) is not None
             and getattr(args, k) != getattr(base, k)]
    if clash:
        raise UsageError(f"flags disagree with the model of {args.model_name}: "
                         + ", ".join(clash))
    return base



def imported_model(args, numerics):
    """The model of the newest checkpoint in --checkpoint-dir if it was imported from
    Hugging Face (its manifest's `hf` entry), else None (the flags' model, checked
    against the checkpoint when it is read)."""
    from engine.hf.convert import checkpoint_config
    from engine.run import checkpoint, checkpoint_stream

    found = checkpoint.list_checkpoints(args.checkpoint_dir)
    if not found:
        return None
    meta = checkpoint_stream.read_meta(found[-1][1])
    if not meta.get("hf"):
        return None
    args.hf, args.model_name = meta["hf"], "hf-checkpoint"
    return dataclasses.replace(checkpoint_config(meta), **numerics)



def with_documents(cfg, args, eos_id: int | None):
    """cfg with the document mask `--document-mask` and `--document-positions` ask for,
    given the data's end-of-document id (None: the data has none). Raises UsageError
    when the mask is asked for and the data has no such token."""
    if args.document_mask == "off" or (args.document_mask == "auto" and eos_id is None):
        if args.document_positions:
            raise UsageError("--document-positions needs data with an end-of-document "
                             f"token (--data {args.data} has none)")
        return dataclasses.replace(cfg, document_eos=None, document_positions=False)
    if eos_id is None:
        raise UsageError(f"--document-mask on needs data with an end-of-document token "
                         f"(--data {args.data} has none)")
    if not 0 <= eos_id < cfg.vocab:
        raise UsageError(f"the data's end-of-document id {eos_id} is outside the model's "
                         f"vocab {cfg.vocab}")
    return dataclasses.replace(cfg, document_eos=int(eos_id),
                               document_positions=bool(args.document_positions))
