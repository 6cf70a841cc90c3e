from datagen_cli import main

main()
