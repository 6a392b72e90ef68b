"""Loss parity on the 2-D mesh (FSDP=2 x TP=2, four processes): bf16 eager, and float8 with its all-gather compiled per block
(one layer: each further block is traced again in each of the four processes; the eager layouts keep two)."""

import pytest

from tests.layout_runs import FLOAT8, assert_close

# Four processes on 2 cores beside another worker's runs.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ONE_LAYER = ["--model.n_layers", "1"]


@pytest.mark.version_specific
def test_2d_mesh_fsdp_x_tp(losses):
    single = losses(["--training.batch_size", "8"])
    mesh2d = losses(["--training.batch_size", "4", "--parallelism.tensor_parallel_degree", "2"], nproc=4)
    assert_close(single, mesh2d, 1e-2, "FSDP=2 x TP=2 vs 1 process")


@pytest.mark.version_specific
def test_2d_mesh_float8_all_gather_and_block_compile(losses):
    # Float8 TP styles, float8 FSDP all-gather and the post-step scale precompute on a 2-D mesh,
    # the blocks traced by dynamo and AOTAutograd (aot_eager: inductor's C++ compiles in four
    # processes took 4 minutes; tests/trainer/distributed/test_parallel_compile.py compiles TP blocks with inductor).
    extra = [*FLOAT8["tensorwise"], "--float8.fsdp_float8_all_gather", "true"]
    single = losses(["--training.batch_size", "8", *ONE_LAYER, *extra])
    mesh2d = losses(["--training.batch_size", "4", "--parallelism.tensor_parallel_degree", "2", *ONE_LAYER,
                     "--compile.mode", "block", "--compile.backend", "aot_eager", *extra], nproc=4)
    assert_close(single, mesh2d, 1e-2, "float8 FSDP=2 x TP=2 compiled vs 1 process eager")


@pytest.mark.version_specific
def test_2d_mesh_blockwise_all_gather_and_block_compile(losses):
    # Blockwise with its float8 all-gather on the 2-D mesh, compiled per block (aot_eager): each TP
    # rank's FSDP shards hold whole 128x128 blocks, several sharded on dim 1 (wq and w1's 128 and
    # 384 TP-local rows would cut blocks over 2 FSDP ranks).
    extra = FLOAT8["blockwise"]
    single = losses(["--training.batch_size", "8", *ONE_LAYER, *extra])
    mesh2d = losses(["--training.batch_size", "4", "--parallelism.tensor_parallel_degree", "2", *ONE_LAYER,
                     "--compile.mode", "block", "--compile.backend", "aot_eager", *extra], nproc=4)
    assert_close(single, mesh2d, 1e-2, "blockwise FSDP=2 x TP=2 compiled vs 1 process eager")
