"""Networks: torch modules for the learner, NumPy forward passes for the actors, and what both
share."""
