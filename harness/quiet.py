"""What a user must not see at default verbosity: lines they cannot act on.

Each pattern is one kind of start-up or framework boilerplate that the product's
libraries print unless told not to (TensorFlow's C++ logging, AutoGraph's conversion
warnings, absl's pre-init notice, Spark's and Horovod's launch chatter)."""

from __future__ import annotations

import re

NOISE_PATTERNS = {
    "TensorFlow's oneDNN notice": r"oneDNN custom operations are on",
    "TensorFlow's CPU-feature notice": r"This TensorFlow binary is optimized|cpu_feature_guard",
    "absl's pre-init notice": r"All log messages before absl::InitializeLog\(\) is called",
    "an AutoGraph conversion warning": r"AutoGraph could not transform|Please report this to the "
    r"TensorFlow team",
    "a glog/absl-formatted log line": r"(?m)^(\[\d+\]<std(?:out|err)>:)?[IWEF]\d{4} \d\d:\d\d:\d\d",
    "a TensorFlow Python warning": r"WARNING:tensorflow|UserWarning|DeprecationWarning",
    "Spark's launch chatter": r"Setting default log level to|NativeCodeLoader|Using Spark's "
    r"default log4j profile|To adjust logging level use sc\.setLogLevel",
    "a CUDA plugin notice": r"Unable to register cu(DNN|FFT|BLAS) factory|TF-TRT Warning",
}


def noise_in(output: str) -> list[str]:
    """'kind: the first matching line' for every kind of noise in `output`."""
    found = []
    for kind, pattern in NOISE_PATTERNS.items():
        match = re.search(pattern, output)
        if match is not None:
            start = output.rfind("\n", 0, match.start()) + 1
            end = output.find("\n", match.end())
            found.append(f"{kind}: {output[start : end if end >= 0 else None]}")
    return found
