"""Ape-X DQN (Horgan et al. 2018): the learner core, the actor core and its exploration ladder."""
