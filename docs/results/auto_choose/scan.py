"""Which algorithm auto.choose picks (first call, int32/float32): the table in docs/exact.md."""
import numpy as np
from sparsecoll.algorithms.auto import choose
i32, f32 = np.int32, np.float32
M = 2**20
print("n=1M density 0.001% (k=10):", {P: choose(P, M, 10 * P, i32, f32) for P in range(2, 65)})
print("n=16M densities 0.1%-10%:", sorted({choose(P, 16 * M, int(d * 16 * M) * P, i32, f32)
      for P in range(2, 9) for d in (0.001, 0.003, 0.01, 0.03, 0.1)}))
print("n=1M density 50%:", sorted({choose(P, M, M // 2 * P, i32, f32) for P in range(4, 65)}))
wins = {}
for P in range(2, 1025):
    for e in range(4, 41):
        for k in (1, 2, 3, 5, 8, 10, 13, 20, 30, 50, 100, 1000):
            if k <= 2**e and choose(P, 2**e, k * P, i32, f32) == "allgather":
                wins.setdefault(P, []).append(k)
print("allgather picked (P: k per rank), P <= 1024, n = 2^4..2^40:",
      {P: sorted(set(v)) for P, v in wins.items()})
