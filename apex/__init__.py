"""apex: distributed reinforcement learning (Ape-X DQN, IMPALA) over ZeroMQ."""

__version__ = "0.1.0"
