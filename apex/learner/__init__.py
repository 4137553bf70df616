"""The learner process and what only it runs: the main loop (process), a group's other ranks
(follower), ingest, metrics."""
