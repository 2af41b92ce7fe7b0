"""The argument and value checks of lossscale.validation, as properties over good and bad values.

Each check is compared with a plain statement of its rule over values hypothesis draws (Python numbers of
every size and kind, bools, strings, None, tensors of every dtype and shape), and every refusal must be an
error a person can act on: it names the call and the argument, states the rule and shows the value.
Whether each entry point calls these checks is tested once per entry point in test_entry_point_checks.py.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale.validation import (
    FLOAT32_MAX,
    INT32_MAX,
    SMALLEST_NORMAL_FLOAT32,
    ArgumentTypeError,
    StateDictError,
    to_float32,
    unlike_tensor,
    validate_choice,
    validate_factor_above_one,
    validate_fraction,
    validate_int_at_least,
    validate_int_in_range,
    validate_positive_or_none,
    validate_scale,
    validated_scale,
    validated_state_dict,
)

CALL = "Thing.setter(x=...)"

# --- values -----------------------------------------------------------------------------------------------

#: Edges of the float32 normal range, and just past them.
EDGES = [
    SMALLEST_NORMAL_FLOAT32,
    math.nextafter(SMALLEST_NORMAL_FLOAT32, 0.0),
    2.0**-127,
    2.0**-149,
    1e-46,
    FLOAT32_MAX,
    math.nextafter(FLOAT32_MAX, math.inf),
    3.4028235677973366e38,
    1e39,
    0.0,
    -0.0,
    1.0,
    2.0**16,
]
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(EDGES + [-x for x in EDGES])
#: Python ints a float holds (ints past float's range: see test_an_int_past_floats_range_is_a_value_error).
ints = st.integers(-(2**1000), 2**1000) | st.sampled_from([0, 1, -1, INT32_MAX, INT32_MAX + 1, 2**40])
not_numbers = st.sampled_from([True, False, None, "8", "1e-3", b"8", [8.0], (8.0,), {"scale": 8.0}, object()])
numbers = floats | ints
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]


@st.composite
def tensors(draw) -> torch.Tensor:
    """A tensor holding a drawn number: 0-d or (1,)/(1, 1), of any real dtype; or one a scale can never be."""
    kind = draw(st.sampled_from(["one", "one", "one", "many", "empty", "grad", "bool", "complex", "meta"]))
    value = draw(floats)
    if kind == "many":
        return torch.tensor([8.0, value])
    if kind == "empty":
        return torch.ones(0)
    if kind == "grad":
        return torch.tensor(8.0 if math.isnan(value) else value, requires_grad=True)
    if kind == "bool":
        return torch.tensor(draw(st.booleans()))
    if kind == "complex":
        return torch.tensor(complex(value, 1.0))
    if kind == "meta":
        return torch.tensor(8.0, device="meta")
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from([(), (1,), (1, 1)]))
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.full(shape, draw(st.integers(info.min, info.max)), dtype=dtype)
    return torch.full(shape, value, dtype=torch.float64).to(dtype)  # float16 and bfloat16 round, or overflow to inf


anything = numbers | not_numbers | tensors()


def is_real(value) -> bool:
    """A Python real number: an int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def float32_of(number: float) -> float:
    """``number`` rounded to float32 by torch (a cast independent of the check's own rounding)."""
    return torch.tensor(number, dtype=torch.float64).float().item()


def refusal(call, value, error) -> str:
    """Run ``call(value)``; assert it raises ``error`` (a wrong type is also a ValueError); return the message."""
    with pytest.raises(error) as info:
        call(value)
    assert isinstance(info.value, ValueError)  # `except ValueError` catches a value of the wrong type too
    return str(info.value)


def assert_names(message: str, *words: str) -> None:
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    assert message.endswith("."), message


# --- validated_scale: the one check of a scale value -----------------------------------------------------------


def scale_rule(value, low: float, high: float):
    """What validated_scale must do with ``value``: the float32 value it returns, or the error it raises.

    A scale is a real Python number or a tensor of one real element (not bool, without grad, on a real device)
    whose float32 value is finite and normal (>= 2**-126) and inside ``[low, high]``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad or value.is_complex() or value.dtype == torch.bool:
            return ArgumentTypeError
        if value.device.type == "meta":
            return ValueError
        number = value.double().item()
    elif is_real(value):
        number = float(value)
    else:
        return ArgumentTypeError
    rounded = float32_of(number)
    if math.isfinite(rounded) and max(low, SMALLEST_NORMAL_FLOAT32) <= rounded <= high:
        return rounded
    return ValueError


bounds = st.tuples(
    st.sampled_from([SMALLEST_NORMAL_FLOAT32, 0.0, 1.0, 2.0**-3, 3.0]),
    st.sampled_from([FLOAT32_MAX, 2.0**20, 3.4e38, 3.0]),
).filter(lambda b: b[0] <= b[1])


@settings(max_examples=200, deadline=None)
@given(anything, bounds)
def test_checked_scale_accepts_exactly_the_normal_float32_values_inside_the_bounds(value, low_high):
    low, high = low_high
    expected = scale_rule(value, low, high)
    check = lambda v: validated_scale(CALL, v, low, high, name="new_scale")  # noqa: E731
    if isinstance(expected, float):
        got = check(value)
        assert got == expected and type(got) is float
        return
    message = refusal(check, value, expected)
    assert message.startswith(CALL + ": new_scale "), message
    if expected is ArgumentTypeError:
        assert_names(message, "must be a float or a 1-element tensor")
    elif isinstance(value, torch.Tensor) and value.device.type == "meta":
        assert_names(message, "meta device", "got tensor(")
    else:
        assert_names(
            message,
            "must be a finite number > 0 whose float32 value is a normal number in",
            f"[{max(low, SMALLEST_NORMAL_FLOAT32)!r}, {high!r}]",
            f"got {value!r}",
        )
        if is_real(value) and math.isfinite(value) and float32_of(value) != value:
            assert f"which is {float32_of(value)!r} in float32" in message  # 1e39 shows its float32 value: inf


# --- the argument checks -------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(anything, st.sampled_from([(1.0, FLOAT32_MAX), (SMALLEST_NORMAL_FLOAT32, FLOAT32_MAX), (4.0, 4.0)]))
def test_check_scale_takes_a_finite_real_number_inside_the_bounds(value, low_high):
    low, high = low_high
    check = lambda v: validate_scale(CALL, "init_scale", v, low=low, high=high)  # noqa: E731
    if not is_real(value):
        message = refusal(check, value, ArgumentTypeError)
    elif math.isfinite(value) and low <= value <= high:
        check(value)
        return
    else:
        message = refusal(check, value, ValueError)
    assert_names(
        message,
        f"{CALL}(init_scale={value!r}): init_scale must be a finite number in [{low!r}, {high!r}]",
        f"got {value!r}",
    )


@settings(max_examples=100, deadline=None)
@given(anything)
def test_check_factor_above_one_takes_a_finite_real_number_above_one(value):
    check = lambda v: validate_factor_above_one(CALL, "growth_factor", v, "it multiplies the scale")  # noqa: E731
    if is_real(value) and math.isfinite(value) and value > 1:
        check(value)
        return
    message = refusal(check, value, ArgumentTypeError if not is_real(value) else ValueError)
    assert_names(
        message,
        f"{CALL}(growth_factor={value!r}): growth_factor must be a finite number > 1 "
        f"(it multiplies the scale); got {value!r}",
    )


@settings(max_examples=100, deadline=None)
@given(anything)
def test_check_fraction_takes_a_real_number_strictly_between_zero_and_one(value):
    check = lambda v: validate_fraction(CALL, "backoff_factor", v, "it multiplies the scale")  # noqa: E731
    if is_real(value) and 0 < value < 1:
        check(value)
        return
    message = refusal(check, value, ArgumentTypeError if not is_real(value) else ValueError)
    assert_names(
        message,
        f"{CALL}(backoff_factor={value!r}): backoff_factor must be in (0, 1) (it multiplies the scale); got {value!r}",
    )


@settings(max_examples=100, deadline=None)
@given(anything | st.none())
def test_check_positive_or_none_takes_none_or_a_finite_positive_number(value):
    check = lambda v: validate_positive_or_none(CALL, "clip_grad_norm", v)  # noqa: E731
    if value is None or (is_real(value) and 0 < value < math.inf):
        check(value)
        return
    message = refusal(check, value, ArgumentTypeError if not is_real(value) else ValueError)
    assert_names(
        message,
        f"{CALL}(clip_grad_norm={value!r}): clip_grad_norm must be None or a finite number > 0",
        f"got {value!r}",
    )


@settings(max_examples=100, deadline=None)
@given(anything | st.integers(), st.sampled_from([0, 1, 10]))
def test_check_int_at_least_takes_an_int_not_a_bool_at_or_above_the_low_end(value, low):
    check = lambda v: validate_int_at_least(CALL, "growth_interval", v, low)  # noqa: E731
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and value >= low:
        check(value)
        return
    message = refusal(check, value, ValueError if is_int else ArgumentTypeError)
    assert_names(
        message, f"{CALL}(growth_interval={value!r}): growth_interval must be an integer >= {low}", f"got {value!r}"
    )


@settings(max_examples=100, deadline=None)
@given(st.integers() | floats | not_numbers, st.sampled_from([(1, INT32_MAX), (0, INT32_MAX), (2, 5)]))
def test_check_int_in_range_refuses_what_an_int32_counter_cannot_hold(value, low_high):
    low, high = low_high
    check = lambda v: validate_int_in_range(CALL, "hysteresis", v, low, high)  # noqa: E731
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and low <= value <= high:
        check(value)
        return
    message = refusal(check, value, ValueError if is_int else ArgumentTypeError)
    if is_int and value > high:
        assert_names(
            message, f"{CALL}(hysteresis={value!r}): hysteresis must be an integer <= {high}", f"got {value!r}"
        )
        assert ("int32" in message) == (high == INT32_MAX)
    else:
        assert_names(message, f"hysteresis must be an integer >= {low}", f"got {value!r}")


CHOICES = [("consecutive", "cumulative"), (True, False), (1, 2)]


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["consecutive", "cumulative", "Consecutive", "", 1, 2, 1.0, 3]) | numbers | not_numbers,
    st.sampled_from(CHOICES),
)
def test_check_choice_takes_one_of_the_allowed_values_and_bools_only_as_bools(value, allowed):
    check = lambda v: validate_choice(CALL, "mode", v, allowed)  # noqa: E731
    if any((value is a) if isinstance(a, bool) else (not isinstance(value, bool) and value == a) for a in allowed):
        check(value)
        return
    message = refusal(check, value, ValueError)
    assert_names(
        message, f"{CALL}(mode={value!r}): mode must be one of {', '.join(map(repr, allowed))}", f"got {value!r}"
    )


@pytest.mark.parametrize(
    "check",
    [
        lambda v: validated_scale(CALL, v, name="new_scale"),
        lambda v: validate_scale(CALL, "init_scale", v, low=1.0, high=FLOAT32_MAX),
        lambda v: validate_factor_above_one(CALL, "growth_factor", v, "it multiplies the scale"),
    ],
    ids=["validated_scale", "validate_scale", "validate_factor_above_one"],
)
def test_an_int_past_floats_range_is_a_value_error(check):
    with pytest.raises(ValueError, match=re.escape(CALL)):
        check(2**1100)


# --- state dicts and tensor layouts --------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["scale", "growth_tracker", "inner", "x"]), st.integers(0, 3))
    | not_numbers
    | st.lists(st.integers(), max_size=2),
    st.sampled_from([("scale",), ("scale", "growth_tracker"), ()]),
)
def test_validated_state_dict_wants_a_dict_with_every_key(state_dict, keys):
    check = lambda d: validated_state_dict(CALL, d, keys, " Hint.")  # noqa: E731
    if not isinstance(state_dict, dict):
        with pytest.raises(TypeError) as info:
            check(state_dict)
        assert_names(
            str(info.value),
            f"{CALL}(state_dict={state_dict!r}): state_dict must be the dict that "
            f"state_dict() returned; got {type(state_dict).__name__}",
        )
        return
    missing = [k for k in keys if k not in state_dict]
    if not missing:
        assert check(state_dict) is state_dict
        return
    with pytest.raises(StateDictError) as info:
        check(state_dict)
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    message = str(info.value)  # the message itself, not a KeyError's quoted repr
    assert message.startswith(f"{CALL}(state_dict with keys {sorted(state_dict)}): missing {missing};")
    assert message.endswith(" Hint.")


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([(), (2,), (2, 3), (3, 2)]),
    st.sampled_from([torch.float32, torch.float64, torch.int64]),
    st.sampled_from([1.0, math.inf, math.nan]),
    st.booleans(),
)
def test_unlike_tensor_describes_what_differs_from_the_expected_layout(shape, dtype, fill, finite):
    like = torch.zeros(2, 3)
    value = torch.full(shape, fill if dtype.is_floating_point else 1, dtype=dtype)
    bad_values = finite and dtype.is_floating_point and not math.isfinite(fill)
    got = unlike_tensor(value, like, finite=finite)
    if shape == (2, 3) and dtype == torch.float32 and not bad_values:
        assert got is None
    else:
        assert got == f"a {'non-finite ' if bad_values else ''}{dtype} tensor of shape {shape}"
    assert unlike_tensor([1.0], like) == "list"


@settings(max_examples=300, deadline=None)
@given(floats)
def test_to_float32_rounds_as_a_float32_cast_does(x):
    got, want = to_float32(x), float32_of(x)
    assert got == want or (math.isnan(got) and math.isnan(want))
