"""Text-pipeline models for tests, built here (no downloads): a WordPiece tokenizer trained on a
few sentences, an ONNX embedding-sum model over input_ids/attention_mask, and a Python
normalization step, written into a model repository."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a batcher merges concurrent requests into one batch",
    "text goes in and answers come out",
    "tokenizers split words into pieces",
    "the server answers every request exactly once",
]
DIM = 8


def tokenizer_json(path: Path) -> Path:
    """A trained WordPiece tokenizer with BERT's special tokens, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tokenizer.train_from_iterator(
        SENTENCES, WordPieceTrainer(vocab_size=120, special_tokens=specials)
    )
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer.decoder = decoders.WordPiece()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def embedding_table(vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((vocab, DIM)).astype(np.float32)


def embedding_sum_model(table: np.ndarray) -> onnx.ModelProto:
    """embedding[b] = sum_t table[input_ids[b, t]] * attention_mask[b, t] (FP32 [-1, DIM])."""
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["vectors"], axis=0),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "last"], ["mask_3d"]),
        helper.make_node("Mul", ["vectors", "mask_3d"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "seq_axis"], ["embedding"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "embedding_sum",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.INT64, ["batch", "sequence"]
            ),
        ],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", DIM])],
        initializer=[
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array([2], np.int64), "last"),
            numpy_helper.from_array(np.array([1], np.int64), "seq_axis"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


NORMALIZE_PY = '''
import numpy as np


class Normalize:
    """Scales each row to unit length (times `scale`)."""

    def load(self, config):
        self.scale = float(config["parameters"].get("scale", 1.0))

    def infer(self, inputs):
        x = inputs["x"]
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        return {"y": (x / np.maximum(norms, 1e-12) * self.scale).astype(np.float32)}
'''

NORMALIZE_CONFIG = f"""backend: python
python:
  inputs: [{{name: x, datatype: FP32, shape: [-1, {DIM}]}}]
  outputs: [{{name: y, datatype: FP32, shape: [-1, {DIM}]}}]
"""

PIPELINE_CONFIG = """pipeline:
  steps:
    - model: tok
      inputs: {text: TEXT}
      outputs: {input_ids: ids, attention_mask: mask}
    - model: embed
      inputs: {input_ids: ids, attention_mask: mask}
      outputs: {embedding: raw}
    - model: norm
      inputs: {x: raw}
      outputs: {y: EMBEDDING}
"""

EMBED_CONFIG = """dynamic_batching:
  pad: {input_ids: {axis: 1, value: 0}, attention_mask: {axis: 1, value: 0}}
"""


def write_text_repository(root: Path, tokenizer_config: str = "backend: tokenizer\n") -> Path:
    """tok (tokenizer), embed (ONNX), norm (Python) and `embedder`, the pipeline of the three."""
    tokenizer_json(root / "tok" / "1" / "tokenizer.json")
    (root / "tok" / "config.yaml").write_text(tokenizer_config)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(root / "tok" / "1" / "tokenizer.json")).get_vocab_size()
    (root / "embed" / "1").mkdir(parents=True)
    onnx.save(embedding_sum_model(embedding_table(vocab)), root / "embed" / "1" / "model.onnx")
    (root / "embed" / "config.yaml").write_text(EMBED_CONFIG)
    (root / "norm" / "1").mkdir(parents=True)
    (root / "norm" / "1" / "model.py").write_text(NORMALIZE_PY)
    (root / "norm" / "config.yaml").write_text(NORMALIZE_CONFIG)
    (root / "embedder").mkdir()
    (root / "embedder" / "config.yaml").write_text(PIPELINE_CONFIG)
    return root


def expected_embeddings(root: Path, texts: list[str], max_length: int = 512) -> np.ndarray:
    """What the `embedder` pipeline computes, done in-process with the libraries themselves."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(root / "tok" / "1" / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_length)
    table = embedding_table(tokenizer.get_vocab_size())
    rows = [table[tokenizer.encode(text).ids].sum(axis=0) for text in texts]
    raw = np.stack(rows).astype(np.float32)
    normalized: np.ndarray = raw / np.maximum(np.linalg.norm(raw, axis=1, keepdims=True), 1e-12)
    return normalized
