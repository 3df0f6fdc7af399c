"""The data group of a run's config: :class:`DataConfig`, the data (prefixes, split,
mock, variable-length, SFT, fill-in-the-middle), its tokenizer and its loader, with the
tokenizer rules Megatron's ``build_tokenizer`` applies.

Field names, defaults and meanings follow megatron/training/arguments.py
(``_add_data_args``, ``_add_tokenizer_args``).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Optional

from jmegatron.config.common import ConfigError, ConfigGroup, refuse_with

# Megatron's --tokenizer-type values read (jmegatron.data.tokenizer.build_tokenizer), those
# refused, the fields that name a run's tokenizer (one of them set: a tokenizer is given) and all
# the fields of its tokenizer (what a checkpoint carries: use_checkpoint_args)
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer")
REFUSED_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer", "SFTTokenizer",
                           "NullMultimodalTokenizer")
TOKENIZER_NAME_FIELDS = ("tokenizer_model", "tokenizer_type", "vocab_file", "merge_file")
TOKENIZER_FIELDS = TOKENIZER_NAME_FIELDS + ("tiktoken_pattern", "tiktoken_num_special_tokens")
TIKTOKEN_DEFAULT_VOCAB_SIZE = 2 ** 17  # Megatron's TikTokenizer without --vocab-size


def tokenizer_vocab_size(tokenizer_type: Optional[str], vocab_size: Optional[int]) -> Optional[int]:
    """The vocabulary (ids before padding) of Megatron's ``--tokenizer-type tokenizer_type
    --vocab-size vocab_size`` where that flag decides it, by each type's own rule
    (megatron/training/tokenizer/tokenizer.py, ``build_tokenizer``): ``NullTokenizer``
    ``vocab_size + 1`` (ids ``0 .. vocab_size - 1`` and the end of document ``vocab_size``:
    ``_NullTokenizer.vocab_size``); ``TikTokenizer`` ``vocab_size`` (default 2^17: the special
    tokens, then the first ``vocab_size - num_special_tokens`` ranks). None for the types whose
    files decide it (``--vocab-size`` is not read by them: HuggingFaceTokenizer, GPT2BPETokenizer,
    SentencePieceTokenizer, Llama2Tokenizer, ...) and for a NullTokenizer without a size."""
    if tokenizer_type == "NullTokenizer":
        return None if vocab_size is None else int(vocab_size) + 1
    if tokenizer_type == "TikTokenizer":
        return int(vocab_size) if vocab_size is not None else TIKTOKEN_DEFAULT_VOCAB_SIZE
    return None


def tokenizer_type_of(cfg: Any) -> Optional[str]:
    """The ``--tokenizer-type`` a run uses: ``cfg.tokenizer_type`` when set; else
    ``"HuggingFaceTokenizer"`` when ``tokenizer_model`` is set; else ``"GPT2BPETokenizer"`` when
    ``vocab_file`` and ``merge_file`` are (Megatron's ``pretrain_gpt.py`` passes
    ``args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}``, which ByteMLPerf's GPT scripts rely
    on); None: no tokenizer is named. ``cfg``: a :class:`JMegatronConfig`, a ConfigDict or a
    dict of its fields (a checkpoint's config.json)."""
    get = cfg.get if isinstance(cfg, dict) else (lambda name: getattr(cfg, name, None))
    if get("tokenizer_type"):
        return get("tokenizer_type")
    if get("tokenizer_model"):
        return "HuggingFaceTokenizer"
    if get("vocab_file") and get("merge_file"):
        return "GPT2BPETokenizer"
    return None



@dataclasses.dataclass(frozen=True)
class DataConfig(ConfigGroup):
    """Where samples come from, how they are tokenized and loaded (jmegatron.data)."""

    # --- data (megatron/training/arguments.py: _add_data_args) ---
    data_path: Optional[str] = None  # "PREFIX" or "W1 PREFIX1 W2 PREFIX2 ..." (Megatron's --data-path, space separated)
    split: str = "969,30,1"
    tokenizer_model: Optional[str] = None  # a tokenizers tokenizer.json / save_pretrained folder, or the file of tokenizer_type
    # Megatron's --tokenizer-type (jmegatron.data.tokenizer.build_tokenizer): HuggingFaceTokenizer
    # (tokenizer_model), GPT2BPETokenizer (vocab_file + merge_file) or NullTokenizer (space-separated
    # ids; vocab_size as Megatron's --vocab-size: ids 0 .. vocab_size - 1 and the end of document
    # vocab_size, so the model has vocab_size + 1: tokenizer_vocab_size);
    # None: HuggingFaceTokenizer when tokenizer_model is set, else GPT2BPETokenizer when vocab_file and
    # merge_file are (Megatron's pretrain_gpt.py default; tokenizer_type_of)
    tokenizer_type: Optional[str] = None
    # SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: tokenizer_model is the
    # sentencepiece .model; TikTokenizer: tokenizer_model is Megatron's JSON rank file, its vocabulary
    # vocab_size (None: 2^17), Megatron's --tiktoken-pattern (v1 | v2) and --tiktoken-num-special-tokens
    tiktoken_pattern: Optional[str] = None
    tiktoken_num_special_tokens: int = 1000
    vocab_file: Optional[str] = None  # GPT2BPETokenizer: GPT-2's vocab.json
    merge_file: Optional[str] = None  # GPT2BPETokenizer: GPT-2's merges.txt
    mock_data: bool = False
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False  # document masking: segment_ids in the batch (models/attention.py)
    # ByteMLPerf's --variable-data / --seq-length-step: samples of seq_length - k * seq_length_step
    # tokens, k in 1..9, padded to the batch's longest (jmegatron.data.gpt_variable_dataset)
    variable_data: bool = False
    seq_length_step: Optional[int] = None
    # ByteMLPerf's --seq-length-min ("minimum sequence length to process", its default 128): under
    # variable_data the shortest sample, seq_length - 9 * seq_length_step, must reach it (the draw
    # itself is ByteMLPerf's, which never reads it)
    seq_length_min: int = 128
    # chat conversations (preprocess_data --apply-chat-template) packed several to a sample
    # (jmegatron.data.sft_dataset)
    sft: bool = False  # Megatron's --sft: SFT data, loss on assistant tokens only (needs reset_attention_mask)
    # Megatron's fill-in-the-middle data (--fim-data ...; jmegatron.data.fim_dataset)
    fim_data: bool = False  # FIM samples: segments reordered prefix/suffix/middle around sentinel tokens
    fim_rate: float = 0.5  # probability to turn a segment (the text between EOD tokens) into FIM
    fim_spm_rate: float = 0.5  # probability that a FIM segment is SPM rather than PSM
    fim_split_sample: Optional[str] = None  # a token splitting segments into fragments, each FIM'd on its own
    fim_fragment_rate: Optional[float] = None  # probability of FIM per fragment (with fim_split_sample)
    fim_no_prefix: Optional[str] = None  # segments whose text starts with this are not FIM'd
    fim_prefix_token: str = "<fim_prefix>"  # FIM sentinel token before the prefix
    fim_middle_token: str = "<fim_middle>"  # FIM sentinel token before the middle
    fim_suffix_token: str = "<fim_suffix>"  # FIM sentinel token before the suffix
    fim_pad_token: str = "<fim_pad>"  # pads a FIM sample to seq_length (not in the loss)
    fim_eod_token: str = "<|endoftext|>"  # the end-of-document token FIM splits samples at
    # Megatron's --num-workers: batches a background thread keeps ready (0: read in the training
    # thread); Megatron's --dataloader-type: "single" stops with an error at the end of a split,
    # "cyclic" starts it again (jmegatron.data.loader)
    num_workers: int = 2
    dataloader_type: str = "single"

    def check_data(self) -> None:
        """Raise ConfigError naming the field: a bad loader setting, SFT / FIM data that is
        mock or mixed, SFT without document masking, FIM rates outside [0, 1], an unknown
        ``tokenizer_type``."""
        if self.num_workers < 0:
            raise ConfigError(f"config.num_workers={self.num_workers} must be >= 0 (0: no prefetch thread).")
        if self.dataloader_type not in ("single", "cyclic"):
            raise ConfigError(f"config.dataloader_type={self.dataloader_type!r} must be 'single' (stop at the end "
                              "of the data, Megatron's default) or 'cyclic' (start it again).")
        for name in ("sft", "fim_data"):
            if getattr(self, name):
                refuse_with(self, name, dict(mock_data=self.mock_data, variable_data=self.sft and self.variable_data,
                                             fim_data=self.sft and self.fim_data),
                            "its samples come from preprocessed data_path prefixes", "unset {name}.")
        if self.sft and not self.reset_attention_mask:
            raise ConfigError("config.sft=True packs several conversations into a sample; set "
                              "config.reset_attention_mask=True so that they do not attend to each other.")
        for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"config.{name}={value} must be a probability in [0, 1].")
        if self.fim_split_sample is not None and self.fim_fragment_rate is None:
            raise ConfigError("config.fim_split_sample is set but config.fim_fragment_rate is not; give the "
                              "probability to turn each fragment into FIM.")
        if self.tokenizer_type is not None and self.tokenizer_type not in TOKENIZER_TYPES:
            close = difflib.get_close_matches(self.tokenizer_type, TOKENIZER_TYPES + REFUSED_TOKENIZER_TYPES, 1, 0.5)
            known = f"; Megatron's {self.tokenizer_type} is not read" if self.tokenizer_type in REFUSED_TOKENIZER_TYPES \
                else (f'; did you mean "{close[0]}"?' if close else "")
            raise ConfigError(f"config.tokenizer_type={self.tokenizer_type!r} is not one of {list(TOKENIZER_TYPES)}"
                              f"{known} (a transformers save_pretrained folder of any tokenizer loads as "
                              f"HuggingFaceTokenizer with tokenizer_model=DIR).")
