"""Tiny Hugging Face encoder folders for tests, built here (nothing is downloaded): a BERT with
random weights from a fixed seed saved with transformers' `save_pretrained`, a WordPiece
tokenizer trained on a few sentences with `tokenizers`, and either a sentence-transformers
layout (`modules.json`: Transformer -> Pooling -> Normalize) or a `BertForSequenceClassification`
with `id2label`."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.text_models import SENTENCES

MORE_SENTENCES = [
    "embeddings place similar sentences close together",
    "a classifier answers with one label per text",
    "long texts are cut at the model's maximum length",
    "every step of the pipeline batches its own requests",
]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
MAX_SEQ_LENGTH = 24
"""sentence-transformers' max_seq_length of the embedding folder: short, so tests cut rows."""


TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
}
MINILM = {
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
}
"""The shape of all-MiniLM-L6-v2 (random weights): the benchmark's model."""


def _tokenizer(
    folder: Path,
    model_max_length: int,
    corpus: Sequence[str] = (),
    vocab_size: int = 200,
    lowercase: bool = True,
) -> int:
    """Train a WordPiece tokenizer with BERT's special tokens and save it as transformers does
    (tokenizer.json, tokenizer_config.json); returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(
        [*SENTENCES, *MORE_SENTENCES, *corpus],
        WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials),
    )
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=model_max_length,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],  # as BERT's
    )
    fast.save_pretrained(str(folder))
    return int(tokenizer.get_vocab_size())


def _bert_config(vocab: int, shape: Mapping[str, int] = TINY, **extra: Any) -> Any:
    from transformers import BertConfig

    positions = 512 if shape is not TINY else 64
    return BertConfig(vocab_size=vocab, max_position_embeddings=positions, **shape, **extra)


def sentence_transformer_folder(
    folder: Path,
    pooling: str = "mean",
    normalize: bool = True,
    seed: int = 0,
    shape: Mapping[str, int] = TINY,
    max_seq_length: int = MAX_SEQ_LENGTH,
    corpus: Sequence[str] = (),
    do_lower_case: bool = False,
    dense_features: int | None = None,
) -> Path:
    """A sentence-transformers folder: BERT (`shape`) -> Pooling(`pooling`) [-> Normalize]; the
    tokenizer is trained on the test sentences plus `corpus`. `do_lower_case`: a folder as
    sentence-transformers 2-4 saved it, whose tokenizer.json keeps case while
    sentence_bert_config.json says `do_lower_case: true` (the library lowercases at load).
    `dense_features`: a Dense layer (tanh) to that many features after pooling."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_modules
    from transformers import BertModel

    with tempfile.TemporaryDirectory() as scratch:
        bert = Path(scratch)
        vocab_size = 200 if shape is TINY else 4000
        limit = 64 if shape is TINY else 512
        vocab = _tokenizer(bert, limit, corpus, vocab_size, lowercase=not do_lower_case)
        torch.manual_seed(seed)
        BertModel(_bert_config(vocab, shape)).save_pretrained(str(bert))
        transformer = st_modules.Transformer(str(bert), max_seq_length=max_seq_length)
        pool = st_modules.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)
        width = transformer.get_embedding_dimension()
        dense = [st_modules.Dense(width, dense_features)] if dense_features else []
        modules = [transformer, pool, *dense, *([st_modules.Normalize()] if normalize else [])]
        SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    if do_lower_case:
        _as_legacy(folder, max_seq_length, pooling)
    return folder


def _as_legacy(folder: Path, max_seq_length: int, pooling: str) -> None:
    """Rewrite the configs as sentence-transformers 2-4 wrote them (most published folders)."""
    config = {"max_seq_length": max_seq_length, "do_lower_case": True}
    (folder / "sentence_bert_config.json").write_text(json.dumps(config))
    modules = json.loads((folder / "modules.json").read_text())
    for module in modules:
        module["type"] = "sentence_transformers.models." + module["type"].rsplit(".", 1)[1]
    (folder / "modules.json").write_text(json.dumps(modules))
    pool = json.loads((folder / "1_Pooling" / "config.json").read_text())
    legacy = {"word_embedding_dimension": pool["embedding_dimension"]}
    modes = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens"}
    for mode in (*modes.values(), "mean_sqrt_len_tokens"):
        legacy[f"pooling_mode_{mode}"] = mode == modes[pooling]
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(legacy))


def classifier_folder(folder: Path, seed: int = 0) -> Path:
    """A BertForSequenceClassification folder with three labels (`LABELS`)."""
    import torch
    from transformers import BertForSequenceClassification

    vocab = _tokenizer(folder, model_max_length=64)
    torch.manual_seed(seed)
    config = _bert_config(
        vocab, id2label=LABELS, label2id={label: i for i, label in LABELS.items()}
    )
    BertForSequenceClassification(config).save_pretrained(str(folder))
    return folder
