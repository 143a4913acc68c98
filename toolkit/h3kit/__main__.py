from h3kit.cli import main

main()
