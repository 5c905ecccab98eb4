"""JAX: sparse collectives inside ``jax.jit``, as calls into the library in program order.

Outside ``jit``, :func:`sparsecoll.allreduce`, :func:`sparsecoll.iallreduce` and
:meth:`sparsecoll.GradientReducer.step` take JAX arrays and return ``jax.Array`` already.
Inside ``jit`` (a traced step), use these::

    from sparsecoll.integrations import jax as sc_jax
    reducer = sparsecoll.GradientReducer(None, n=grad_size, algorithm="oktopk", density=0.01)

    @jax.jit
    def train_step(params, batch):
        grads = jax.grad(loss)(params, batch)
        flat, unravel = jax.flatten_util.ravel_pytree(grads)
        update = sc_jax.step(reducer, flat)          # dense in, averaged dense update out
        return jax.tree.map(lambda p, u: p - lr * u, params, unravel(update))

:func:`step` and :func:`allreduce_dense` keep the input's shape; :func:`allreduce` returns a
fixed-capacity sparse result ``(indices, values, count)``. Every call of these functions is
a collective: every rank must run the same jitted programs in the same order. Jax is
imported only when these functions are used.
"""

from __future__ import annotations

from ._ops import allreduce, allreduce_dense, original_errors, step

__all__ = ["allreduce", "allreduce_dense", "original_errors", "step"]
