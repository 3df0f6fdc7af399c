"""SFT data (jmegatron/data/sft_dataset.py, preprocess_data --apply-chat-template): the loss mask of
the chat template against hand-built spans and Megatron's per-turn masking, the packing against
Megatron's SFTDataset.__getitem__, blends of two prefixes, a training run whose loss counts only
assistant tokens, and distillation masked to them. A tiny BPE with a ChatML template is built here."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.config import ConfigError, load_config_file
from jmegatron.data.blended_dataset import BlendedDataset, build_train_valid_test_datasets
from jmegatron.data.indexed_dataset import IndexedDataset
from jmegatron.data.sft_dataset import ChatTemplateTokenizer, SFTDataset, loss_mask_prefix, pack_conversations
from jmegatron.tools.preprocess_data import preprocess

# ChatML; the generation block holds what the assistant writes: its reply, <|im_end|> and the newline
GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the same text without generation blocks (found by rendering prefixes)
PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HAND = [  # line 2 holds two conversations (a new one at every system message, as Megatron splits)
    {"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello there"},
                  {"role": "assistant", "content": "good day"}, {"role": "user", "content": "and you?"},
                  {"role": "assistant", "content": "well, thanks"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"},
                  {"role": "assistant", "content": "because"},
                  {"role": "system", "content": "be loud"}, {"role": "user", "content": "speak"},
                  {"role": "assistant", "content": "HARK"}]},
    {"messages": [{"role": "user", "content": "no system here"}, {"role": "assistant", "content": "fine by me"}]},
]
WORDS = "the king queen castle night sword crown ghost river storm wine letter ring horse".split()
IGNORE_INDEX = -100


def conversations(n, seed, system):
    rng = np.random.default_rng(seed)
    say = lambda k: " ".join(rng.choice(WORDS, size=k))  # noqa: E731
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": f"{system} {i}"}]
        for _ in range(1 + i % 2):
            msgs += [{"role": "user", "content": say(2 + i % 3)}, {"role": "assistant", "content": say(1 + i % 4)}]
        out.append({"messages": msgs})
    return out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("sft")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS)] * 20 + [json.dumps(HAND)] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                            chat_template=GENERATION_TEMPLATE).save_pretrained(d / "tok")
    (d / "plain.jinja").write_text(PLAIN_TEMPLATE)
    hand = write_jsonl(d / "hand.jsonl", HAND)
    out = {"dir": d, "tok": str(d / "tok"), "plain": str(d / "plain.jinja")}
    out["gen"] = preprocess([hand], str(d / "gen"), str(d / "tok"), ["messages"], apply_chat_template=True, log=None)[0]
    out["hand"] = preprocess([hand], str(d / "hand"), str(d / "tok"), ["messages"], apply_chat_template=True,
                             chat_template=out["plain"], log=None)[0]
    out["a_jsonl"] = write_jsonl(d / "a.jsonl", conversations(40, 1, "first"))
    out["a"] = preprocess([out["a_jsonl"]], str(d / "a"), str(d / "tok"), ["messages"], apply_chat_template=True,
                          log=None)[0]
    out["b"] = preprocess([write_jsonl(d / "b.jsonl", conversations(30, 2, "second"))], str(d / "b"), str(d / "tok"),
                          ["messages"], apply_chat_template=True, log=None)[0]
    out["chat"] = ChatTemplateTokenizer(out["tok"], out["plain"])
    return out


def test_assistant_spans_by_hand_and_both_template_paths(data):
    toks = IndexedDataset(data["hand"])
    masks = IndexedDataset(loss_mask_prefix(data["hand"]))
    gen_toks, gen_masks = IndexedDataset(data["gen"]), IndexedDataset(loss_mask_prefix(data["gen"]))
    assert len(toks) == 4 and masks.dtype == np.uint8  # 3 lines, the second cut at its second system message
    hf = data["chat"]._hf
    expected = [["good day<|im_end|>\n", "well, thanks<|im_end|>\n"], ["because<|im_end|>\n"], ["HARK<|im_end|>\n"],
                ["fine by me<|im_end|>\n"]]
    for i in range(4):
        ids, flags = np.asarray(toks[i]), np.asarray(masks[i])
        # the flagged tokens are exactly the assistant replies with their end of turn, run by run
        runs = np.split(np.arange(ids.size), np.flatnonzero(np.diff(flags.astype(int))) + 1)
        spans = [hf.decode(ids[r].tolist()) for r in runs if flags[r[0]]]
        assert spans == expected[i], i
        # the text is the template's, and the generation-block path agrees token for token
        assert hf.decode(ids.tolist()).startswith("<|im_start|>")
        np.testing.assert_array_equal(ids, gen_toks[i])
        np.testing.assert_array_equal(flags, gen_masks[i])


def megatron_turn_targets(hf, conversation, template, assistant_prefix_len):
    """Megatron's SFTTokenizer.tokenize_conversation (sft_tokenizer.py), transcribed: every turn
    rendered alone, system/user turns IGNORE_INDEX, the first assistant_prefix_len tokens of an
    assistant turn IGNORE_INDEX, the rest kept."""
    tokens = np.asarray(hf.apply_chat_template(conversation, tokenize=True, chat_template=template,
                                               return_dict=True)["input_ids"])
    target, idx = tokens.copy(), 0
    for turn in conversation:
        turn_tokens = np.asarray(hf.apply_chat_template([turn], tokenize=True, chat_template=template,
                                                        return_dict=True)["input_ids"])
        n = len(turn_tokens)
        assert np.array_equal(tokens[idx:idx + n], turn_tokens)
        if turn["role"] in ("system", "user", "tool"):
            target[idx:idx + n] = IGNORE_INDEX
        else:
            target[idx:idx + assistant_prefix_len] = IGNORE_INDEX
        idx += n
    assert idx == len(tokens)
    return tokens, target


def megatron_sft_getitem(convs, pack_length, pad):
    """Megatron's SFTDataset.__getitem__ (megatron/training/datasets/sft_dataset.py, context
    parallel 1), transcribed: conversations concatenated, truncated or padded to pack_length + 1,
    shifted by one; returns tokens, labels, loss_mask, position_ids, cu_seqlens."""
    pack_tokens, pack_targets, pack_positions, cu_seqlens = [], [], [], [0]
    for tokens, targets in convs:
        pack_tokens.extend(tokens)
        pack_targets.extend(targets)
        pack_positions.extend(range(len(tokens)))
        cu_seqlens.append(len(pack_tokens))
        if len(pack_tokens) >= pack_length + 1:
            pack_tokens = pack_tokens[:pack_length] + [pad]
            pack_targets = pack_targets[:pack_length] + [pad]
            pack_positions = pack_positions[:pack_length + 1]
            cu_seqlens[-1] = len(pack_tokens) - 1
            break
    if len(pack_tokens) < pack_length + 1:
        pad_len = pack_length + 1 - len(pack_tokens)
        pack_tokens.extend([pad] * pad_len)
        pack_targets.extend([pad] * pad_len)
        pack_positions.extend(range(pack_positions[-1] + 1, pack_positions[-1] + 1 + pad_len))
        cu_seqlens[-1] = len(pack_tokens) - 1
    labels = np.asarray(pack_targets[1:])
    loss_mask = np.ones(pack_length, np.float32)
    loss_mask[(labels == pad) | (labels == IGNORE_INDEX)] = 0.0
    return np.asarray(pack_tokens[:-1]), labels, loss_mask, np.asarray(pack_positions[:-1]), np.asarray(cu_seqlens)


def test_masks_and_packing_match_megatron(data):
    chat, hf = data["chat"], data["chat"]._hf
    prefix_len = len(hf.backend_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False).ids)
    toks, masks = IndexedDataset(data["hand"]), IndexedDataset(loss_mask_prefix(data["hand"]))
    convs = [HAND[0]["messages"], HAND[1]["messages"][:3], HAND[1]["messages"][3:], HAND[2]["messages"]]
    targets = []
    for i, conv in enumerate(convs):  # Megatron's per-turn masking gives the stored flags
        tokens, target = megatron_turn_targets(hf, conv, chat.chat_template, prefix_len)
        np.testing.assert_array_equal(tokens, toks[i])
        np.testing.assert_array_equal(target != IGNORE_INDEX, masks[i].astype(bool))
        targets.append(target)
    pad = 0  # <|endoftext|>
    for seq_length in (64, 32):  # all four fit in two packs / the longest (39 tokens) is cut on the right
        ds = SFTDataset(toks, np.arange(4), None, seq_length, 7, pad_id=pad)
        seen = []
        for i in range(len(ds)):
            pack = ds.pack(i).tolist()
            seen += pack
            ours = ds[i]
            ref_tok, ref_lab, ref_mask, ref_pos, cu = megatron_sft_getitem(
                [(list(toks[d]), list(targets[d])) for d in pack], seq_length, pad)
            # a pack of seq_length + 1 tokens or more takes Megatron's truncation branch, which puts a
            # pad where the last label was; here that label is the pack's next real token
            truncated = sum(len(toks[d]) for d in pack) >= seq_length + 1
            keep = slice(None, -1) if truncated else slice(None)
            np.testing.assert_array_equal(ours["tokens"], ref_tok)
            np.testing.assert_array_equal(ours["position_ids"], ref_pos)
            np.testing.assert_array_equal(ours["loss_mask"][keep], ref_mask[keep])
            counted = ref_mask[keep] > 0
            np.testing.assert_array_equal(ours["labels"][keep][counted], ref_lab[keep][counted])
            # Megatron's cu_seqlens are where our segment ids change
            np.testing.assert_array_equal(np.flatnonzero(np.diff(ours["segment_ids"])) + 1, cu[1:-1])
        assert sorted(seen) == [0, 1, 2, 3]  # one epoch: every conversation once
    assert ds.num_truncated == 1


def test_packing_invariants_and_epochs(data):
    toks = IndexedDataset(data["a"])
    flags = IndexedDataset(loss_mask_prefix(data["a"]))
    lengths = toks.sequence_lengths
    off, members = pack_conversations(lengths, 65)
    assert sorted(members.tolist()) == list(range(len(lengths)))
    sums = np.add.reduceat(lengths[members], off[:-1])
    assert sums.max() <= 65 and len(sums) <= np.ceil(lengths.sum() / 65) * 11 / 9 + 1  # near the ideal count
    ds = SFTDataset(toks, np.arange(len(toks)), 3 * len(sums), 64, 3, pad_id=0)
    assert ds.num_epochs >= 3 and len(ds) >= 3 * len(sums)
    per_epoch = sum(int(flags[d].sum()) for d in range(len(toks)))
    counted = 0
    for i in range(len(ds)):
        s = ds[i]
        assert all(s[k].shape == (64,) for k in s)
        seg, pos = s["segment_ids"], s["position_ids"]
        starts = np.flatnonzero(np.diff(seg)) + 1
        assert np.all(pos[starts] == 0) and pos[0] == 0 and np.all(np.diff(seg) >= 0)
        assert np.all(s["loss_mask"][starts - 1] == 0)  # a conversation never predicts the next one's first token
        counted += int(s["loss_mask"].sum())
    assert counted == ds.num_epochs * per_epoch  # every assistant token of every epoch, nothing else
    again = SFTDataset(toks, np.arange(len(toks)), 3 * len(sums), 64, 3, pad_id=0)
    np.testing.assert_array_equal(again[5]["tokens"], ds[5]["tokens"])  # same seed, same samples


def test_blend_of_two_prefixes(data):
    sizes = (40, 8, 8)
    train, valid, test = build_train_valid_test_datasets(["0.7", data["a"], "0.3", data["b"]], "8,1,1", sizes, 48, 5,
                                                         eod_id=0, sft=True, vocab_size=400)
    assert isinstance(train, BlendedDataset) and all(isinstance(d, SFTDataset) for d in train.datasets)
    assert len(train) >= 40 and valid is not None and test is not None
    hf = ChatTemplateTokenizer(data["tok"])._hf
    texts = [hf.decode(train[i]["tokens"].tolist()) for i in range(len(train))]
    assert all(("first" in t) != ("second" in t) for t in texts)  # a sample packs one prefix's conversations
    assert 0.6 <= np.mean(["first" in t for t in texts]) <= 0.8  # the 0.7 / 0.3 weights


def test_bad_input_is_refused(data, tmp_path):
    toks = IndexedDataset(data["a"])
    (tmp_path / "t.jsonl").write_text('{"text": "no chat"}\n')
    tok_only = preprocess([str(tmp_path / "t.jsonl")], str(tmp_path / "t"), data["tok"], log=None)[0]
    with pytest.raises(FileNotFoundError, match="apply-chat-template"):
        SFTDataset(IndexedDataset(tok_only), np.arange(1), None, 32, 0, pad_id=0)
    with pytest.raises(ValueError, match="other sequence lengths"):
        SFTDataset(toks, np.arange(3), None, 32, 0, pad_id=0, loss_mask_dataset=IndexedDataset(data["b"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}))
    with pytest.raises(ValueError, match="empty assistant turn"):
        preprocess([str(bad)], str(tmp_path / "bad"), data["tok"], ["messages"], apply_chat_template=True, log=None)
    bad.write_text(json.dumps({"messages": [{"role": "narrator", "content": "x"}]}))
    with pytest.raises(ValueError, match="message 0"):
        preprocess([str(bad)], str(tmp_path / "bad"), data["tok"], ["messages"], apply_chat_template=True, log=None)
    assert not (tmp_path / "bad_messages_document.bin").exists()
    # a template that renders earlier turns differently once more follow (the assistant reply dropped)
    (tmp_path / "drop.jinja").write_text(
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}\n{% endif %}"
        "{% endfor %}")
    with pytest.raises(ValueError, match="generation"):
        ChatTemplateTokenizer(data["tok"], str(tmp_path / "drop.jinja")).tokenize_conversation(HAND[0]["messages"])
    with pytest.raises(ValueError, match="append-eod"):
        preprocess([data["a_jsonl"]], str(tmp_path / "x"), data["tok"], ["messages"], append_eod=True,
                   apply_chat_template=True, log=None)
    for bad, match in (([{"content": "no role"}], "message 0 must be"), ([], "non-empty list"),
                       ("text", "non-empty list")):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": bad}) + "\n")
        with pytest.raises(ValueError, match=match):
            preprocess([str(tmp_path / "bad.jsonl")], str(tmp_path / "y"), data["tok"], ["messages"],
                       apply_chat_template=True, log=None)
    with pytest.raises(ConfigError, match="reset_attention_mask=True"):
        load_config_file("configs/sft_tiny.py", dict(data_path=data["a"], tokenizer_model=data["tok"],
                                                     reset_attention_mask=False))


class _ShiftedTeacher:
    """The teacher model with ``delta`` added to its logits (to show which positions count)."""

    def __init__(self, model, delta):
        self.model, self.cfg, self.delta = model, model.cfg, delta

    def apply(self, variables, *args, **kwargs):
        return self.model.apply(variables, *args, **kwargs) + self.delta


def test_sft_training_counts_only_assistant_tokens_and_kd_is_masked(data, tmp_path):
    from jmegatron.data.loader import BatchLoader
    from jmegatron.distill.config import parse_distill_config
    from jmegatron.distill.loss_func import distillation_loss_fn
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.pretrain_gpt import pretrain

    cfg = load_config_file("configs/sft_tiny.py", dict(
        data_path=data["a"], tokenizer_model=data["tok"], num_layers=1, hidden_size=32, ffn_hidden_size=64,
        num_attention_heads=2, seq_length=64, max_position_embeddings=64, micro_batch_size=2, global_batch_size=4,
        train_iters=3, lr_warmup_iters=1, eval_interval=0, eval_iters=1, split="8,1,1", save=str(tmp_path / "run"),
        hidden_dropout=0.0, attention_dropout=0.0))
    out = pretrain(cfg, create_mesh(cfg, jax.devices()[:1]))
    assert sorted(out["losses"]) == [1, 2, 3] and all(np.isfinite(v) for v in out["losses"].values())
    run = out["run"]
    from jmegatron.data.builder import build_datasets
    train, _, _ = build_datasets(cfg, run.global_batch_size)
    batch = BatchLoader(train, run.global_batch_size, run.num_microbatches, split="train").batch_at(0)
    total, count = jax.device_get(run.eval_step(out["state"].params, run.put_batch(batch, train=False)))
    # the loss's token count is the assistant tokens of the batch's conversations, counted by
    # transformers' own assistant mask of each conversation (the generation template)
    hf = ChatTemplateTokenizer(data["tok"])._hf
    lines = [json.loads(line)["messages"] for line in open(data["a_jsonl"])]
    packs = [train.pack(i) for i in range(run.global_batch_size)]
    assistant = sum(sum(hf.apply_chat_template(lines[d], tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)["assistant_masks"])
                    for p in packs for d in p.tolist())
    assert float(count) == assistant and np.isfinite(float(total))

    # distillation on this batch: the KD loss reads only the assistant positions
    micro = {k: jnp.asarray(np.asarray(v)[0]) for k, v in batch.items()}
    micro["sample_offset"] = jnp.int32(0)
    mask = np.asarray(micro["loss_mask"])
    params = out["state"].params
    vocab = run.model.apply({"params": params}, micro["tokens"], micro["position_ids"],
                            segment_ids=micro["segment_ids"]).shape[-1]
    noise = np.random.default_rng(0).normal(size=mask.shape + (vocab,)).astype(np.float32) * 3

    def kd(delta):
        fn = distillation_loss_fn(run.model, _ShiftedTeacher(run.model, jnp.asarray(delta)), parse_distill_config(None))
        _, report = fn(params, micro, jax.random.PRNGKey(0), jnp.float32(mask.sum()), params,
                       lambda x, context_only=False: x)
        return float(report["logits_distillation_loss"])

    base = kd(np.zeros_like(noise))
    assert kd(noise * (mask == 0)[..., None]) == base  # prompts, padding: no effect
    assert abs(kd(noise * (mask > 0)[..., None]) - base) > 1e-3  # assistant tokens: they count
