"""``python -m streamdata.testing {s3,gcs,http}``: run one test server in the foreground."""

from . import main

main()
