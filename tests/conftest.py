import os

# Distributed tests spawn their own processes; keep each one from oversubscribing the 2 CI cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
