from asyncpipe.cli import main

main()
