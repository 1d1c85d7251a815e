"""The backward cut into B (input gradient) and W (weight gradient) by dependency
(engine/parallel/backward_split.py): together they give the whole backward's outputs
exactly (the same equations, run in two parts), and W recomputes nothing of B's chain:
the matmuls of B and of W add up to the whole backward's."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from engine.parallel import backward_split


def layer(x_BD, w):
    """A residual MLP under remat, called through jit, with a cond on the sign of a sum
    (sub-jaxprs of every kind the engine's backward holds)."""
    h_BF = jnp.tanh(jnp.einsum("BD,DF->BF", x_BD, w["a"]))
    y_BD = jnp.einsum("BF,FD->BD", h_BF, w["b"])
    y_BD = jax.lax.cond(jnp.sum(y_BD) > 0, lambda y: y * 2.0, lambda y: y * 0.5, y_BD)
    return x_BD + y_BD


def model(params, x_BD):
    step = jax.checkpoint(lambda x, w: (jax.jit(layer)(x, w), None))
    y_BD, _ = jax.lax.scan(step, x_BD, params["blocks"])
    return jnp.sum(jnp.einsum("BD,DV->BV", y_BD, params["head"]) ** 2)


def setup(seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda *s: jnp.asarray(0.3 * rng.normal(size=s), jnp.float32)
    params = {"blocks": {"a": draw(3, 4, 6), "b": draw(3, 6, 4)}, "head": draw(4, 5)}
    x_BD = draw(2, 4)
    _, f_vjp = jax.vjp(model, params, x_BD)
    leaves, treedef = jax.tree.flatten(f_vjp)

    def backward(leaves, ct):
        d_params, dx_BD = jax.tree.unflatten(treedef, leaves)(ct)
        return [*jax.tree.leaves(d_params), dx_BD]

    args = (leaves, jnp.float32(1.0))
    n = len(jax.tree.leaves(params))
    return backward, args, n


def dots(closed) -> int:
    """dot_general equations in a jaxpr, every sub-jaxpr counted per appearance."""
    count = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            count[eqn.primitive.name] += 1
            for sub in core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return count["dot_general"]


def test_b_and_w_give_the_whole_backward():
    backward, args, n = setup()
    split = backward_split.split(backward, *args, b_out=[False] * n + [True])
    flat = jax.tree.leaves(args)
    outs_b, cross = jax.jit(split.b)(flat)
    reads = [a if m else None for a, m in zip(flat, split.w_reads)]
    outs_w = jax.jit(split.w)(reads, cross)
    want = jax.jit(backward)(*args)
    for k, w in enumerate(want):
        got = outs_b[k] if split.need_b[k] else outs_w[k]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w))  # the same ops
    assert split.need_b == (False,) * n + (True,)  # every weight gradient in W here


def test_w_recomputes_nothing_of_b():
    """Matmuls: B's and W's add up to the whole backward's (the remat recompute and the
    input-gradient chain once, in B), and W holds the weight gradients' (one per weight
    use in the scan's body, and the head's)."""
    backward, args, n = setup()
    split = backward_split.split(backward, *args, b_out=[False] * n + [True])
    flat = jax.tree.leaves(args)
    _, cross = split.b(flat)
    b = jax.make_jaxpr(split.b)(flat)
    w = jax.make_jaxpr(lambda f, c: split.w(f, c))(
        [a if m else None for a, m in zip(flat, split.w_reads)], cross)
    whole = jax.make_jaxpr(backward)(*args)
    assert dots(b) + dots(w) == dots(whole)
    assert dots(w) == 3  # d a, d b in the body; d head
    assert split.plan.cross  # W reads B's values: the layers' output cotangents
