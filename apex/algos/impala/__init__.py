"""IMPALA (Espeholt et al. 2018): the learner core (V-trace) and the actor core (unrolls)."""
