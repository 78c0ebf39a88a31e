import sys

from qwen_trt.cli import main

sys.exit(main())
