from adpfleet.cli import main

raise SystemExit(main())
