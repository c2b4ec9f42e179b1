"""Load an exported program (a `torch.export.save` archive) without running code from the file.

`torch.export.load` is not safe for a file from elsewhere: when its safe unpickler refuses a
pickle in the archive it retries with the full one (`weights_only=False`), it plain-unpickles
"opaque object" constants, it evaluates the archive's symbolic shapes with `sympy.sympify`
(Python `eval`), and `ExportedProgram.module()` later compiles the archive's guards, and Python
source that torch.fx writes with the archive's names in it, with `exec`.

So without `--trust-pickle` the archive is read here, piece by piece, from one in-memory copy
(what is checked is what is loaded): every pickle goes through torch's safe unpickler only
(`TORCH_FORCE_WEIGHTS_ONLY_LOAD`, torch's documented switch, also covers the calls torch makes
itself); constants must be tensors; every shape expression and guard must be plain arithmetic on
shapes, and every name that reaches generated source a plain word. Anything else is refused with
a message naming `--trust-pickle`, which hands the file to `torch.export.load` unchanged.
Operators are checked by torch's own verifier when the program is built (only aten operators,
higher-order operators and symbolic arithmetic may be called).

This reads torch's archive layout (torch.export.pt2_archive), as torch itself does."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from converters.errors import ConversionError
from converters.quiet import quiet

MODEL = "model"
"""The program in the archive that `torch.export.load` returns."""
TRUST = (
    "loading it could run code from the file; pass --trust-pickle if you trust where it came from"
)

_SYMPY_FUNCTIONS = frozenset(
    {
        *("Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min"),
        *("Abs", "floor", "ceiling", "sqrt", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality"),
        *("Unequality", "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan"),
        *("And", "Or", "Not", "Xor", "Piecewise", "ExprCondPair", "ITE"),
    }
)
_SYMPY_CONSTANTS = frozenset({"oo", "zoo", "nan", "pi", "E", "true", "false"})
_SYMBOL = re.compile(r"[a-z]+[0-9]+")
_WORD = re.compile(r"[A-Za-z0-9_.+-]*")
_ARITHMETIC = (
    ast.Expression,
    ast.Load,
    ast.BinOp,
    ast.UnaryOp,
    ast.Compare,
    ast.BoolOp,
    ast.operator,
    ast.unaryop,
    ast.cmpop,
    ast.boolop,
)
_NAME_PART = re.compile(r"[A-Za-z0-9_]+")
_SHAPE_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})


def load_exported_program(path: Path, trust_pickle: bool) -> Any:
    """The archive's ExportedProgram; ConversionError if it would need code run to load."""
    import torch

    try:
        if trust_pickle:
            with quiet():
                return torch.export.load(str(path))
        data = path.read_bytes()  # one read: what is checked is what is loaded
        with quiet(), _weights_only():
            program = _deserialize(data, path)
    except pickle.UnpicklingError as exc:
        raise ConversionError(
            f"'{path}' holds a pickle that is not plain tensors; {TRUST}"
        ) from exc
    except ConversionError:
        raise
    except Exception as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConversionError(f"'{path}' is not a readable exported program: {first}") from exc
    _check_program(program, path)
    return program


def _check_program(program: Any, path: Path) -> None:
    """What `ExportedProgram.module()` turns into code: the guards, constant string inputs
    (quoted into a guard) and the names it writes into the module's Python source."""
    for name in _source_names(program):
        if not all(_NAME_PART.fullmatch(part) for part in name.split(".")):
            raise ConversionError(f"'{path}' names an input or weight {name!r}; {TRUST}")
    for guard in program._guards_code:
        if not _is_shape_check(guard):
            raise ConversionError(
                f"'{path}' has a guard that is not a shape check ({guard!r}); {TRUST}"
            )
    for node in program.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, str) and repr(value) != f"'{value}'":
            raise ConversionError(f"'{path}' has input {node.name} = {value!r}; {TRUST}")


def _deserialize(data: bytes, path: Path) -> Any:
    import torch

    try:
        from torch._export.serde import schema
        from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass
        from torch.export.pt2_archive import _package as package
        from torch.export.pt2_archive import constants as layout
    except ImportError as exc:  # the layout is torch's own and moves between versions
        raise ConversionError(
            f"sluice cannot check exported programs with torch {torch.__version__} ({exc}), so "
            f"'{path}' is not loaded; {TRUST}"
        ) from exc

    with package.PT2ArchiveReader(io.BytesIO(data)) as reader:
        version = reader.read_string(layout.ARCHIVE_VERSION_PATH)
        if version != layout.ARCHIVE_VERSION_VALUE:
            raise ConversionError(
                f"'{path}' is archive version {version}; this torch reads version "
                f"{layout.ARCHIVE_VERSION_VALUE} (re-save it with torch.export.save)"
            )
        names = set(reader.get_file_names())
        program_bytes = reader.read_bytes(layout.MODELS_FILENAME_FORMAT.format(MODEL))
        for expression in _values(json.loads(program_bytes), "expr_str"):
            if not isinstance(expression, str) or not _is_arithmetic(expression):
                raise ConversionError(
                    f"'{path}' has a symbolic shape that is not arithmetic ({expression!r}); "
                    + TRUST
                )
        constants_config = layout.CONSTANTS_CONFIG_FILENAME_FORMAT.format(MODEL)
        if constants_config in names:
            config = package._load_payload_config(reader, constants_config)
            for name, meta in config.config.items():
                if not meta.path_name.startswith(layout.TENSOR_CONSTANT_FILENAME_PREFIX):
                    raise ConversionError(
                        f"'{path}' has constant '{name}' that is a pickled Python object, not a "
                        f"tensor; {TRUST}"
                    )
        state_dict = package._load_state_dict(reader, MODEL)
        constants = package._load_constants(reader, MODEL)
        sample_inputs = _unpickle(
            reader.read_bytes(layout.SAMPLE_INPUTS_FILENAME_FORMAT.format(MODEL)),
            f"'{path}': its sample inputs",
        )
    serialized = _bytes_to_dataclass(schema.ExportedProgram, program_bytes)
    return ExportedProgramDeserializer().deserialize(
        serialized, state_dict, constants, sample_inputs
    )


def _unpickle(blob: bytes, what: str) -> Any:
    import torch

    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as exc:
        raise ConversionError(f"{what} are a pickle that is not plain tensors; {TRUST}") from exc


@contextlib.contextmanager
def _weights_only() -> Iterator[None]:
    """Make every torch.load in the block use the safe unpickler, whatever its caller asks."""
    names = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _source_names(program: Any) -> Iterator[str]:
    """Names from the archive that torch.fx writes verbatim into generated Python: argument
    names, keyword-argument names (of the module and of each call in its graphs), and the
    attribute paths of weights, constants and subgraphs."""
    from torch import fx

    for entry in program.module_call_graph:
        if entry.signature is not None:
            yield from entry.signature.forward_arg_names or ()
    in_spec = program.call_spec.in_spec
    if in_spec is not None and in_spec.num_children == 2 and in_spec.child(1).type is dict:
        yield from in_spec.child(1).context
    signature = program.graph_signature
    for spec in (*signature.input_specs, *signature.output_specs):
        if spec.target is not None:
            yield spec.target
    yield from program.state_dict
    yield from program.constants
    graphs = [m.graph for m in program.graph_module.modules() if isinstance(m, fx.GraphModule)]
    for node in (node for graph in graphs for node in graph.nodes):
        yield from node.kwargs
        if isinstance(node.target, str):  # get_attr and placeholder targets
            yield node.target


def _values(tree: Any, key: str) -> Iterator[Any]:
    """Every value stored under `key` anywhere in a JSON tree."""
    if isinstance(tree, dict):
        for name, value in tree.items():
            if name == key:
                yield value
            else:
                yield from _values(value, key)
    elif isinstance(tree, list):
        for value in tree:
            yield from _values(value, key)


def _parse(text: str) -> ast.Expression | None:
    if "__" in text:  # dunder names and strings are how eval'd text reaches other Python
        return None
    try:
        return ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return None


def _is_arithmetic(text: str) -> bool:
    """A sympy expression as torch writes shapes (`Mul(Integer(2), Symbol('s0', ...))`): calls of
    sympy and torch shape functions on numbers, symbols and plain words, nothing that sympify
    could turn into other Python."""
    import sympy
    from torch.utils._sympy import functions

    calls = _SYMPY_FUNCTIONS | {
        name
        for name, value in vars(functions).items()
        if isinstance(value, type) and issubclass(value, sympy.Basic)
    }

    def allowed(node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            return isinstance(node.func, ast.Name) and node.func.id in calls
        if isinstance(node, ast.Name):
            return (
                node.id in calls or node.id in _SYMPY_CONSTANTS or bool(_SYMBOL.fullmatch(node.id))
            )
        if isinstance(node, ast.keyword):
            return node.arg is not None
        if isinstance(node, ast.Constant):
            return not isinstance(node.value, str) or bool(_WORD.fullmatch(node.value))
        return isinstance(node, _ARITHMETIC)

    tree = _parse(text)
    return tree is not None and all(allowed(node) for node in ast.walk(tree))


def _is_shape_check(text: str) -> bool:
    """A guard as torch writes them (`L['x'].size()[0] >= 3`): comparisons and arithmetic of
    numbers and the inputs' sizes, strides and offsets."""

    def allowed(node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id == "L"
        if isinstance(node, ast.Attribute):
            return node.attr in _SHAPE_METHODS
        if isinstance(node, ast.Call):
            return isinstance(node.func, ast.Attribute) and not node.keywords
        if isinstance(node, ast.Constant):
            return not isinstance(node.value, str) or node.value.isidentifier()
        return isinstance(node, (*_ARITHMETIC, ast.Subscript))

    tree = _parse(text)
    return tree is not None and all(allowed(node) for node in ast.walk(tree))
