from streamdata.cli import main

raise SystemExit(main())
