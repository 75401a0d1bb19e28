"""Driver side (a command on the driver's machine): ``python -m mlflow_hvd.tracking.replay
BUNDLE_DIR [--tracking-uri URI]``, the documented command that sends a saved bundle; the
code is :mod:`mlflow_hvd.driver.tracking.replay`."""

import sys

from mlflow_hvd.driver.tracking.replay import main

if __name__ == "__main__":
    sys.exit(main())
