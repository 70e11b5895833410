from specverify.cli import main

raise SystemExit(main())
