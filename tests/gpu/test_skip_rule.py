"""The GPU tier skips a check only for the one known condition (``tests/gpu/nccl.py``): NCCL's
duplicate-GPU refusal where the ranks outnumber the GPUs. Any other ``ncclInvalidUsage`` (a real
misuse of NCCL, a bug) fails the check. Runs on every machine; exact strings."""

from tests.gpu.nccl import shared_gpu_refusal

DUPLICATE = ("[rank1]:   NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1d000\n"
             "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage "
             "(run with NCCL_DEBUG=WARN for details), NCCL version 2.21.5\nncclInvalidUsage: This usually "
             "reflects invalid usage of NCCL library.\n")
OTHER_MISUSE = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, "
                "NCCL version 2.21.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
                "Last error:\nInvalid config blocking attribute value -2147483648\n")


def test_only_the_duplicate_gpu_refusal_on_a_shared_gpu_skips():
    assert shared_gpu_refusal(DUPLICATE, num_ranks=2, num_gpus=1) == (
        "[rank1]:   NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1d000")
    assert shared_gpu_refusal(OTHER_MISUSE, num_ranks=2, num_gpus=1) is None  # ncclInvalidUsage alone: a failure
    assert shared_gpu_refusal(DUPLICATE, num_ranks=2, num_gpus=2) is None  # one GPU each: nothing to refuse
    assert shared_gpu_refusal("", num_ranks=2, num_gpus=1) is None
