"""``python -m mdl.report <folders>``: see mdl.report.build."""

import sys

from mdl.report.build import main

sys.exit(main())
