"""The workers: the supervisor, a worker's ask -> train -> tell, and every way an attempt ends."""
