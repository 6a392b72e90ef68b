"""Loss parity of compiled training: eager, per-block and whole-model compile, and per-block compile under TP.

One layer: a block's graph is the subject, and each further block is traced again (dynamo guards on the module).
"""

import pytest

from tests.layout_runs import FLOAT8, assert_close

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ONE_LAYER = ["--training.batch_size", "8", "--model.n_layers", "1"]


@pytest.mark.version_specific
def test_compile_modes_same_losses(losses):
    # Per block with inductor: its kernels (RMSNorm, rotary, SwiGLU, the losses they feed) against eager.
    # The whole model with aot_eager: dynamo and AOTAutograd trace the embedding, the blocks, the output and
    # the loss as one graph (where graph breaks and the model's own code would show), without a second
    # minute of inductor's C++ compiles of the same kernels; on a GPU, scripts/gpu_check.py compiles it with
    # inductor ("compile-model").
    eager = losses(ONE_LAYER)
    for mode, backend in (("block", "inductor"), ("model", "aot_eager")):
        compiled = losses([*ONE_LAYER, "--compile.mode", mode, "--compile.backend", backend])
        assert_close(eager, compiled, 1e-2, f"compile {mode} ({backend}) vs none")


@pytest.mark.version_specific
@pytest.mark.parametrize("precision", ["bf16", "tensorwise"])
def test_tensor_parallel_with_block_compile(losses, precision):
    # Compiled blocks take the embedding's sequence-sharded output as input; its gradient
    # must reach the embedding (torch 2.13 dropped it for a local-tensor input).
    # bf16 compiles with inductor, which lowers TP's collectives inside the blocks; float8 with
    # aot_eager: dynamo and AOTAutograd trace the float8 TP styles' DTensor graphs as inductor
    # would be given them (this is where torch versions broke them), without 2 minutes of C++
    # compiles of the same block in both processes. The GPU check compiles them with inductor.
    extra = FLOAT8[precision]
    backend = ["--compile.backend", "inductor" if precision == "bf16" else "aot_eager"]
    single = losses([*ONE_LAYER, *extra])
    tp = losses([*ONE_LAYER, "--parallelism.tensor_parallel_degree", "2", "--compile.mode", "block", *backend, *extra],
                nproc=2)
    assert_close(single, tp, 1e-2, f"{precision} TP=2 compiled per block vs 1 process eager")
