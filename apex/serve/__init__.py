"""`apex serve`: episodes that external clients step, over HTTP and ZeroMQ, fed to a learner."""
