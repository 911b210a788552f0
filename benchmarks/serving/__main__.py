from benchmarks.serving.cli import main

main()
