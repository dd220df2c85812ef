import sys

from tools.train.train import main

sys.exit(main())
