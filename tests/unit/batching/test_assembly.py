from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from batching.assembly import Layout, Padding, SplitError, bucket, concat, group_key, split

DTYPES = st.sampled_from([np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_])


@given(
    dtype=DTYPES,
    tail=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    counts=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    data=st.data(),
)
def test_concat_split_round_trip(
    dtype: type, tail: list[int], counts: list[int], data: st.DataObject
) -> None:
    parts = [
        {"a": data.draw(hnp.arrays(dtype, (n, *tail))), "b": np.arange(n * 2).reshape(n, 2)}
        for n in counts
    ]
    batch, layout = concat(parts, {})
    assert batch["a"].shape[0] == sum(counts)
    back = split(batch, layout)
    for part, result in zip(parts, back, strict=True):
        np.testing.assert_array_equal(part["a"], result["a"])
        np.testing.assert_array_equal(part["b"], result["b"])


def test_padding_pads_to_longest_and_split_cuts_back() -> None:
    parts = [{"ids": np.ones((1, 3), np.int64)}, {"ids": np.full((2, 5), 7, np.int64)}]
    batch, layout = concat(parts, {"ids": Padding(axis=1, value=-9, outputs={"h": (1,)})})
    assert batch["ids"].shape == (3, 5)
    assert batch["ids"][0].tolist() == [1, 1, 1, -9, -9]
    outputs = {"h": np.repeat(batch["ids"][:, :, None], 2, axis=2), "pooled": batch["ids"][:, :1]}
    back = split(outputs, layout)
    assert back[0]["h"].shape == (1, 3, 2)
    assert back[0]["h"][0, :, 0].tolist() == [1, 1, 1]
    assert back[1]["h"].shape == (2, 5, 2)
    assert back[0]["pooled"].shape == (1, 1)  # not an output that follows the padded axis


def test_output_as_long_as_the_padded_axis_is_not_cut_unless_it_follows_it() -> None:
    # The case: a [B, 4] classifier output of a request padded 3 -> 4 came back [1, 3].
    parts = [{"ids": np.ones((1, 3), np.int64)}, {"ids": np.full((1, 4), 2, np.int64)}]
    logits = np.arange(8, dtype=np.float32).reshape(2, 4)
    for padding in (Padding(axis=1, value=0), Padding(axis=1, value=0, outputs={"h": (2,)})):
        _, layout = concat(parts, {"ids": padding})
        hidden = np.zeros((2, 5, 4), np.float32)
        back = split({"logits": logits, "h": hidden}, layout)
        assert [part["logits"].shape for part in back] == [(1, 4), (1, 4)]
        np.testing.assert_array_equal(back[0]["logits"], logits[:1])
        np.testing.assert_array_equal(back[1]["logits"], logits[1:])
        assert back[0]["h"].shape == ((1, 5, 3) if padding.outputs else (1, 5, 4))


def test_every_padded_input_cuts_the_outputs_that_follow_it() -> None:
    parts = [
        {"ids": np.ones((1, 2), np.int64), "mask": np.ones((1, 2), np.int64)},
        {"ids": np.ones((1, 6), np.int64), "mask": np.ones((1, 6), np.int64)},
    ]
    padding = {
        "ids": Padding(axis=1, value=0, outputs={"h": (1,)}),
        "mask": Padding(axis=1, value=0, outputs={"h": (1,), "attn": (2,)}),
    }
    _, layout = concat(parts, padding)
    outputs = {"h": np.zeros((2, 6, 3)), "attn": np.zeros((2, 1, 6)), "cls": np.zeros((2, 6))}
    first, second = split(outputs, layout)
    assert (first["h"].shape, first["attn"].shape, first["cls"].shape) == (
        (1, 2, 3), (1, 1, 2), (1, 6),
    )  # fmt: skip
    assert (second["h"].shape, second["attn"].shape) == ((1, 6, 3), (1, 1, 6))


@given(lengths=st.lists(st.integers(1, 6), min_size=2, max_size=5), data=st.data())
def test_padded_round_trip_gives_each_request_its_own_outputs(
    lengths: list[int], data: st.DataObject
) -> None:
    # An echo model: `same` is the input, `square` an outer product [B, seq, seq], `cls` a
    # [B, 6] output that never follows the padded axis (6 is also the longest length drawn).
    parts = [{"ids": data.draw(hnp.arrays(np.int64, (1, n), elements=st.integers(1, 9)))}
             for n in lengths]  # fmt: skip
    padding = {"ids": Padding(axis=1, value=0, outputs={"same": (1,), "square": (1, 2)})}
    batch, layout = concat(parts, padding)
    ids = batch["ids"]
    cls = np.arange(len(parts) * 6).reshape(len(parts), 6)
    back = split({"same": ids, "square": ids[:, :, None] * ids[:, None, :], "cls": cls}, layout)
    for index, (part, result) in enumerate(zip(parts, back, strict=True)):
        np.testing.assert_array_equal(result["same"], part["ids"])
        np.testing.assert_array_equal(result["square"], part["ids"][:, :, None] * part["ids"])
        np.testing.assert_array_equal(result["cls"], cls[index : index + 1])


def test_split_refuses_an_output_whose_padded_axis_has_another_length() -> None:
    parts = [{"ids": np.ones((1, 3), np.int64)}, {"ids": np.ones((1, 5), np.int64)}]
    _, layout = concat(parts, {"ids": Padding(axis=1, value=0, outputs={"h": (1,)})})
    with pytest.raises(SplitError, match="output 'h' axis 1 has length 4; the padded length is 5"):
        split({"h": np.zeros((2, 4))}, layout)
    _, layout = concat(parts, {"ids": Padding(axis=1, value=0, outputs={"h": (2,)})})
    with pytest.raises(SplitError, match="output 'h' has 2 dimensions; it has no axis 2"):
        split({"h": np.zeros((2, 5))}, layout)


def test_split_checks_row_counts() -> None:
    with pytest.raises(SplitError, match="output 'y' has 3 rows; the batch has 4 rows"):
        split({"y": np.zeros((3, 2))}, Layout((2, 2), ((), ())))
    with pytest.raises(SplitError, match="output 'y' has a scalar"):
        split({"y": np.float32(1.0)}, Layout((1,), ((),)))  # type: ignore[dict-item]


def test_group_key_separates_shapes_and_buckets_padded_lengths() -> None:
    pad = {"ids": Padding(axis=1, value=0)}
    key = lambda n: group_key({"ids": np.zeros((1, n), np.int64)}, pad, 1.5)  # noqa: E731
    assert key(4) == key(5)
    assert key(4) != key(9)
    assert group_key({"x": np.zeros((1, 3))}, {}, 1.5) != group_key(
        {"x": np.zeros((1, 4))}, {}, 1.5
    )
    assert group_key({"x": np.zeros((2, 3))}, {}, 1.5) == group_key(
        {"x": np.zeros((5, 3))}, {}, 1.5
    )


def test_bucket_ratio_bounds_padding_waste() -> None:
    for length in range(2, 500):
        same = [n for n in range(2, 500) if bucket(n, 1.5) == bucket(length, 1.5)]
        assert max(same) / min(same) < 1.5 + 1e-9 or max(same) - min(same) <= 1
    assert bucket(7, 1.0) == 7
    assert len({bucket(0, 1.5), bucket(1, 1.5), bucket(2, 1.5)}) == 3
