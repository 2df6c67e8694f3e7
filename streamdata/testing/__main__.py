"""``python -m streamdata.testing {s3,gcs,http}``: run one test server in the foreground."""

from streamdata.testing import main

main()
