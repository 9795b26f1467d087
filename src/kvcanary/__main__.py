from kvcanary.cli import main
import sys
sys.exit(main())
