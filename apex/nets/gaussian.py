"""What the NumPy and the torch Gaussian policies share: the clamp of the log standard
deviation and log(2 pi) of the density."""

import math

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0
LOG_2PI = math.log(2 * math.pi)
