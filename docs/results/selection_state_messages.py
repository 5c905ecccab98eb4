"""Messages quoted in docs/training.md (Checkpoint: the selection's state, the predicted cut, the
DDP hook's iteration). Run: python docs/results/selection_state_messages.py"""

import pickle

import numpy as np

import sparsecoll
from sparsecoll import GradientReducer
from sparsecoll.integrations.torch import SparseHookState

comm = sparsecoll.Communicator()  # COMM_WORLD: one rank, run with python
g = np.random.default_rng(0).standard_normal(400)
red = GradientReducer(comm, 400, "allgather", 0.05, selection="reuse")
red.step(g)
for edit in ({"interval": 4}, {"_t": "x"}):
    s = pickle.loads(pickle.dumps(red.state_dict()))
    s["selection_state"].update(edit)
    del s["selection_options"]
    try:
        GradientReducer(comm, 400, "allgather", 0.05, selection="reuse").load_state_dict(s)
    except Exception as e:
        print(type(e).__name__, e)
print(sorted(red.state_dict()["topk_state"].items()))
print(len(pickle.dumps(red.state_dict()["topk_state"])), "bytes pickled")
h = SparseHookState(comm, "allgather", density=0.05)
h.reducer(0, 400, "torch.float32").step(g.astype(np.float32))
try:
    h.load_state_dict({**h.state_dict(), "iteration": 2.7})
except Exception as e:
    print(type(e).__name__, e)
