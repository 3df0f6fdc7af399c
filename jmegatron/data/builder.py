"""A run's train, valid and test datasets from its config (the role of Megatron's
``build_train_valid_test_datasets`` in megatron/training/training.py, which sizes the splits
and hands them to megatron/core/datasets/blended_megatron_dataset_builder.py; here
:func:`jmegatron.data.blended_dataset.build_train_valid_test_datasets`)."""

from __future__ import annotations

from jmegatron.config import JMegatronConfig, tokenizer_type_of
from jmegatron.data.blended_dataset import build_train_valid_test_datasets
from jmegatron.data.gpt_variable_dataset import GPTVariableDataset
from jmegatron.data.teacher_logits import TeacherLogitsDataset
from jmegatron.data.tokenizer import build_tokenizer, vocab_size_of

def get_train_valid_test_num_samples(cfg: JMegatronConfig, global_batch_size: int) -> tuple[int, int, int]:
    """Samples per split, as Megatron's ``get_train_valid_test_num_samples``
    (megatron/training/training.py): ``train_samples`` (or ``train_iters * gbs``);
    ``(train_iters // eval_interval + 1) * eval_iters * gbs`` validation samples, enough for
    every evaluation plus the one at the end, since the validation iterator continues from
    one evaluation to the next; ``eval_iters * gbs`` test samples. With
    ``eval_fixed_batches`` every evaluation reads the same first ``eval_iters`` batches, so
    only those are built. ``eval_interval = 0`` (no evaluation during training) counts one
    evaluation."""
    train = cfg.train_samples if cfg.train_samples is not None else cfg.train_iters * global_batch_size
    evaluations = 1 if cfg.eval_fixed_batches or not cfg.eval_interval else cfg.train_iters // cfg.eval_interval + 1
    return train, evaluations * cfg.eval_iters * global_batch_size, cfg.eval_iters * global_batch_size


def build_datasets(cfg: JMegatronConfig, global_batch_size: int):
    """(train, valid, test) datasets sized by :func:`get_train_valid_test_num_samples`; with
    ``cfg.variable_data`` each is wrapped in ByteMLPerf's
    :class:`~jmegatron.data.gpt_variable_dataset.GPTVariableDataset` (ByteMLPerf uses it for
    all three splits). With ``cfg.kd_teacher_logits_path`` the training split carries the
    cached teacher top-K (:class:`jmegatron.data.teacher_logits.TeacherLogitsDataset`).
    ``cfg.sft``: every prefix's splits are packed chat conversations
    (:class:`jmegatron.data.sft_dataset.SFTDataset`, padding with the tokenizer's eod);
    ``cfg.fim_data``: fill-in-the-middle samples
    (:class:`jmegatron.data.fim_dataset.GPTFIMDataset` with the ``fim_*`` fields).
    Raises ValueError (data_path, split, FIM tokens; CacheMismatchError for a cache of other
    data) or FileNotFoundError for missing prefixes, loss masks or cache."""
    num_samples = get_train_valid_test_num_samples(cfg, global_batch_size)
    kind = tokenizer_type_of(cfg)
    if kind == "GPT2BPETokenizer" and not cfg.tokenizer_type:
        print("[jmegatron] tokenizer_type not given: GPT2BPETokenizer, for vocab_file and merge_file (Megatron's "
              "pretrain_gpt.py default)", flush=True)
    tokenizer = build_tokenizer(cfg) if kind else None
    eod = None if tokenizer is None else tokenizer.eod
    fim = None
    if cfg.fim_data:
        fim = dict(tokenizer=tokenizer, fim_rate=cfg.fim_rate, fim_spm_rate=cfg.fim_spm_rate,
                   fim_split_sample=cfg.fim_split_sample, fim_fragment_rate=cfg.fim_fragment_rate,
                   fim_no_prefix=cfg.fim_no_prefix,
                   fim_extra_tokens=dict(prefix=cfg.fim_prefix_token, middle=cfg.fim_middle_token,
                                         suffix=cfg.fim_suffix_token, pad=cfg.fim_pad_token, eod=cfg.fim_eod_token))
    data_path = cfg.data_path.split() if cfg.data_path else []
    splits = build_train_valid_test_datasets(
        data_path=data_path, split=cfg.split, train_valid_test_num_samples=num_samples,
        seq_length=cfg.seq_length, seed=cfg.seed, eod_id=eod, mock=cfg.mock_data,
        vocab_size=vocab_size_of(cfg), eod_mask_loss=cfg.eod_mask_loss,
        reset_position_ids=cfg.reset_position_ids, reset_attention_mask=cfg.reset_attention_mask,
        sft=cfg.sft, fim=fim)
    if cfg.kd_teacher_logits_path and not cfg.kd_finalize:  # offline distillation: the cached teacher top-K
        splits = (TeacherLogitsDataset(splits[0], cfg.kd_teacher_logits_path, cfg, num_samples[0]),) + tuple(splits[1:])
    if not cfg.variable_data:
        return splits
    return tuple(None if ds is None else GPTVariableDataset(ds, cfg.seq_length, cfg.seq_length_step, cfg.seed,
                                                            0 if eod is None else eod, cfg.eod_mask_loss,
                                                            seq_length_min=cfg.seq_length_min)
                 for ds in splits)

