"""APPO: asynchronous PPO on IMPALA's architecture (``learner``, ``loss``)."""
