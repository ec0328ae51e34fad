"""Between processes: the collectives (the one place Horovod is imported), elastic
membership, the ranks' agreement, devices and CPUs per rank, what a launcher
tells a process, and preemption signals. Imports nothing at package level, so
that the launcher's and preemption's pure-Python parts load no TensorFlow."""
