"""Tiny Hugging Face encoder folders for tests, built here (nothing is downloaded): a BERT with
random weights from a fixed seed saved with transformers' `save_pretrained`, a WordPiece
tokenizer trained on a few sentences with `tokenizers`, and either a sentence-transformers
layout (`modules.json`: Transformer -> Pooling -> Normalize) or a `BertForSequenceClassification`
with `id2label`."""

from __future__ import annotations

import tempfile
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


def _tokenizer(folder: Path, model_max_length: int) -> int:
    """Train a WordPiece tokenizer with BERT's special tokens and save it as transformers does
    (tokenizer.json, tokenizer_config.json); returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(
        SENTENCES + MORE_SENTENCES, WordPieceTrainer(vocab_size=200, special_tokens=specials)
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


def _bert_config(vocab: int, **extra: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        **extra,
    )


def sentence_transformer_folder(
    folder: Path, pooling: str = "mean", normalize: bool = True, seed: int = 0
) -> Path:
    """A sentence-transformers folder: BERT -> Pooling(`pooling`) [-> Normalize]."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_modules
    from transformers import BertModel

    with tempfile.TemporaryDirectory() as scratch:
        bert = Path(scratch)
        vocab = _tokenizer(bert, model_max_length=64)
        torch.manual_seed(seed)
        BertModel(_bert_config(vocab)).save_pretrained(str(bert))
        transformer = st_modules.Transformer(str(bert), max_seq_length=MAX_SEQ_LENGTH)
        pool = st_modules.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)
        modules = [transformer, pool, *([st_modules.Normalize()] if normalize else [])]
        SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


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
