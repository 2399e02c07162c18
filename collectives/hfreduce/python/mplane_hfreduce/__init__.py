"""mplane_hfreduce: HFReduce (libmplane-hfreduce) from Python and PyTorch.

    comm = Communicator(rank, world_size, unique_id)       # unique_id = get_unique_id() on one rank, sent out of band
    comm = Communicator.from_process_group(group)          # the id goes through torch.distributed
    all_reduce(tensor, comm, op="sum")                     # in place, CPU or CUDA tensors
    model.register_comm_hook(comm, ddp_comm_hook)          # DDP's gradient all-reduce on HFReduce

Importing this package needs no torch; the tensor functions import it when called.
"""
from ._lib import HFReduceError, load  # noqa: F401
from .comm import Communicator, get_unique_id  # noqa: F401
from .torch_hook import all_reduce, ddp_comm_hook  # noqa: F401
