"""The recipe search: the pure selection algorithm and the driver that runs real trials."""
