"""The Keras facade: Keras 3's LossScaleOptimizer calls, and each base keyword argument doing what Keras documents.

Keras 3 refuses the base arguments on its LossScaleOptimizer; here each one acts on the unscaled gradients.
Every test compares one ``apply`` against the update Keras's documentation describes, written out by hand
on powers of two (exact in float32) with an SGD inner optimizer (``v -= lr * g``).
"""

import math

import pytest
import torch

from lossscale.compat.keras import BASE_KWARGS, LossScaleOptimizer

LR = 0.5


def setup(values=(3.0, -4.0), **kwargs):
    v = torch.nn.Parameter(torch.tensor(values))
    opt = LossScaleOptimizer(torch.optim.SGD([v], lr=LR), initial_scale=2.0**8, dynamic_growth_steps=2, **kwargs)
    return v, opt


def apply(opt, grad):
    """Keras's custom training step: the gradient of ``scale_loss(loss)``, i.e. the gradient times the scale."""
    opt.apply([torch.as_tensor(grad, dtype=torch.float32) * opt.dynamic_scale])


def test_plain_apply_unscales_skips_and_grows():
    v, opt = setup()
    apply(opt, [1.0, 2.0])
    assert v.detach().tolist() == [3.0 - LR, -4.0 - 2 * LR]
    opt.apply([torch.tensor([math.nan, 0.0])])
    assert v.detach().tolist() == [2.5, -5.0] and float(opt.dynamic_scale) == 2.0**7
    assert int(opt.iterations) == 1  # the skipped step does not count (the inner optimizer was not applied)
    apply(opt, [0.0, 0.0])
    apply(opt, [0.0, 0.0])
    assert float(opt.dynamic_scale) == 2.0**8 and int(opt.iterations) == 3


def test_scale_loss_and_apply_gradients():
    v, opt = setup()
    assert float(opt.scale_loss(torch.tensor(3.0))) == 3.0 * 2**8
    opt.apply_gradients([(torch.tensor([2.0**8, 0.0]), v)])
    assert v.detach().tolist() == [3.0 - LR, -4.0]


def test_weight_decay_is_decoupled_before_the_step():
    v, opt = setup(weight_decay=0.25)
    apply(opt, [1.0, 1.0])
    expected = [x - x * 0.25 * LR - LR * 1.0 for x in (3.0, -4.0)]  # variable - variable * wd * lr, then SGD
    assert v.detach().tolist() == pytest.approx(expected, abs=0, rel=1e-7)
    opt.apply([torch.tensor([math.inf, 0.0])])  # a skipped step does not decay either
    assert v.detach().tolist() == pytest.approx(expected, abs=0, rel=1e-7)


def test_clipnorm_clips_each_variable():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1))
    opt = LossScaleOptimizer(torch.optim.SGD([a, b], lr=1.0), initial_scale=4.0, clipnorm=1.0)
    opt.apply([torch.tensor([3.0, 4.0]) * 4, torch.tensor([0.5]) * 4])
    assert a.detach().tolist() == pytest.approx([-0.6, -0.8]) and b.detach().tolist() == [-0.5]  # b under the norm


def test_clipvalue_clips_each_value():
    v, opt = setup(clipvalue=1.0)
    apply(opt, [4.0, -0.5])
    assert v.detach().tolist() == [3.0 - LR * 1.0, -4.0 + LR * 0.5]


def test_global_clipnorm_clips_all_gradients_together():
    a = torch.nn.Parameter(torch.zeros(1))
    b = torch.nn.Parameter(torch.zeros(1))
    opt = LossScaleOptimizer(torch.optim.SGD([a, b], lr=1.0), initial_scale=4.0, global_clipnorm=1.0)
    opt.apply([torch.tensor([3.0]) * 4, torch.tensor([4.0]) * 4])  # global norm 5
    # torch's 1e-6 epsilon in the coefficient: Keras has none
    assert [float(a.detach()), float(b.detach())] == pytest.approx([-0.6, -0.8], rel=1e-6)


def test_loss_scale_factor_scales_the_loss_and_divides_the_gradients():
    v, opt = setup(loss_scale_factor=4.0)
    loss_scaled = opt.scale_loss(torch.tensor(1.0))
    assert float(loss_scaled) == 2.0**8 * 4.0
    opt.apply([torch.tensor([1.0, 2.0]) * loss_scaled])  # d(scaled loss)/dv for loss = v . [1, 2]
    assert v.detach().tolist() == [3.0 - LR, -4.0 - 2 * LR]  # the same update as without the factor


def test_gradient_accumulation_averages_and_steps_every_n_calls():
    v, opt = setup(gradient_accumulation_steps=2)
    apply(opt, [1.0, 2.0])
    assert v.detach().tolist() == [3.0, -4.0]  # accumulating
    apply(opt, [3.0, 0.0])
    assert v.detach().tolist() == [3.0 - LR * 2.0, -4.0 - LR * 1.0]  # the mean of the two
    assert int(opt.iterations) == 2
    apply(opt, [1.0, 1.0])
    opt.apply([torch.tensor([math.inf, 0.0])])  # an overflow anywhere in the window skips the window
    assert v.detach().tolist() == [2.0, -4.5] and float(opt.dynamic_scale) == 2.0**7


def test_ema_follows_keras_first_step_copy_then_average_and_overwrite():
    v, opt = setup((0.0,), use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3)
    apply(opt, [-1.0])  # v = 0.5; Keras's first average is the variable itself
    assert opt.ema.shadow[0].tolist() == [0.5]
    opt.apply([torch.tensor([math.inf])])  # skipped: the average does not move
    assert opt.ema.shadow[0].tolist() == [0.5]
    apply(opt, [-1.0])  # v = 1.0; average = 0.5 * 0.5 + 0.5 * 1.0
    assert opt.ema.shadow[0].tolist() == [0.75] and v.detach().tolist() == [1.0]
    apply(opt, [-1.0])  # v = 1.5; average 1.125; third applied step: v overwritten by the average
    assert opt.ema.shadow[0].tolist() == [1.125] and v.detach().tolist() == [1.125]
    apply(opt, [-2.0])
    opt.finalize_variable_values()
    assert v.detach().tolist() == opt.ema.shadow[0].tolist()


def test_apply_to_some_variables_and_learning_rate():
    a = torch.nn.Parameter(torch.zeros(1))
    b = torch.nn.Parameter(torch.zeros(1))
    opt = LossScaleOptimizer(torch.optim.SGD([a, b], lr=1.0), initial_scale=2.0)
    opt.learning_rate = 0.5
    assert opt.learning_rate == 0.5
    opt.apply([torch.tensor([2.0])], [b])
    assert (float(a.detach()), float(b.detach())) == (0.0, -0.5)
    with pytest.raises(ValueError, match="got 2 gradients for 1 variables"):
        opt.apply([torch.ones(1), torch.ones(1)], [a])
    with pytest.raises(ValueError, match="is not a parameter of the inner optimizer"):
        opt.apply([torch.ones(1)], [torch.nn.Parameter(torch.zeros(1))])


def test_accepts_exactly_the_documented_base_arguments():
    assert sorted(BASE_KWARGS) == sorted(
        [
            "weight_decay",
            "clipnorm",
            "clipvalue",
            "global_clipnorm",
            "use_ema",
            "ema_momentum",
            "ema_overwrite_frequency",
            "loss_scale_factor",
            "gradient_accumulation_steps",
            "name",
        ]
    )
    with pytest.raises(TypeError, match=r"LossScaleOptimizer\(momentum=...\): unexpected keyword argument"):
        setup(momentum=0.9)


# --- issue 14: Keras's (and R's) documented arguments ---------------------------------------------------


def test_name_is_accepted_and_kept():
    _, opt = setup(name="lso")
    assert opt.name == "lso"
    _, default = setup()
    assert default.name == "loss_scale_optimizer"


@pytest.mark.parametrize("name", [3, b"lso", ["lso"]])
def test_name_must_be_a_string(name):
    with pytest.raises(TypeError, match=r"LossScaleOptimizer\(name=.*name must be a str or None; got"):
        setup(name=name)


def test_r_null_defaults_mean_kerass_defaults():
    _, opt = setup(
        use_ema=None,
        ema_momentum=None,
        ema_overwrite_frequency=None,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
    )
    assert opt.use_ema is False and opt.ema is None and opt.ema_momentum == 0.99
    _, with_ema = setup(use_ema=True, ema_momentum=None)
    assert with_ema.ema_momentum == 0.99 and with_ema.ema.momentum == 0.99


def test_ema_momentum_one_keeps_the_first_applied_weights():
    v, opt = setup((0.0,), use_ema=True, ema_momentum=1.0)
    apply(opt, [-1.0])  # v = 0.5; Keras's first average is the variable itself
    apply(opt, [-1.0])  # v = 1.0; momentum 1: the average does not move
    apply(opt, [-2.0])
    assert v.detach().tolist() == [2.0] and opt.ema.shadow[0].tolist() == [0.5]


@pytest.mark.parametrize(
    "momentum, error",
    [
        (1.0000001, ValueError),
        (-0.1, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (True, TypeError),
        ("0.9", TypeError),
    ],
)
def test_ema_momentum_outside_zero_one_is_refused(momentum, error):
    with pytest.raises(
        error,
        match=r"LossScaleOptimizer\(ema_momentum=.*ema_momentum must be None or a "
        r"number in \[0, 1\]; got",
    ):
        setup(use_ema=True, ema_momentum=momentum)


@pytest.mark.parametrize("loss", [2.0, 3, torch.tensor(2.0).numpy()[()]])
def test_scale_loss_accepts_python_and_numpy_scalars(loss):
    _, opt = setup()
    scaled = opt.scale_loss(loss)
    assert isinstance(scaled, torch.Tensor) and float(scaled) == float(loss) * 2.0**8


@pytest.mark.parametrize("loss", ["2.0", None, True, [1.0]])
def test_scale_loss_refuses_what_is_not_a_loss(loss):
    _, opt = setup()
    with pytest.raises(
        TypeError,
        match=r"LossScaleOptimizer.scale_loss\(loss=.*loss must be a tensor or a real "
        r"number; got",
    ):
        opt.scale_loss(loss)


@pytest.mark.parametrize("overflow_at", [None, 1, 2])
def test_a_checkpoint_mid_accumulation_resumes_the_same_run(overflow_at):
    """apply() accumulates without a backward; its state_dict mid-window loads into a fresh optimizer (through
    torch.save / torch.load(weights_only=True)) and the continued run equals the uninterrupted one bit for bit."""
    import io

    grads = [[1.0, -2.0], [0.5, 0.25], [3.0, 1.0], [-1.0, 2.0], [0.75, -0.5]]
    if overflow_at is not None:
        grads[overflow_at] = [math.inf, 0.0]

    def run(stop=None):
        v, opt = setup(gradient_accumulation_steps=2)
        for i, g in enumerate(grads):
            if i == stop:
                buffer = io.BytesIO()
                torch.save(opt.state_dict(), buffer)
                buffer.seek(0)
                v, fresh = setup(values=v.detach().tolist(), gradient_accumulation_steps=2)
                fresh.load_state_dict(torch.load(buffer, weights_only=True))
                opt = fresh
            apply(opt, g)
        return v.detach().tolist(), float(opt.dynamic_scale), int(opt.iterations)

    whole = run()
    assert run(stop=1) == whole and run(stop=3) == whole  # saved with one micro-step of two applied
