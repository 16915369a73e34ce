from proxies.collectives.bench import entry

entry()
